"""Run a target's torch-function substitutes while capturing (``estimator.corrections``).

Where the target runs other aten ops than the CPU would (CUDA attention backends, the fused
dropout kernel), the registry holds a substitute that calls the target's ops on the fake CPU
tensors; this mode routes the calls to it.  Not installed for targets without substitutes.

Backward stays inside the mode: ``handle_torch_function`` pops a mode while its handler runs,
so ``loss.backward()`` passed through as it is would run the whole backward without it -- and
the recomputation of checkpointed modules (their forward, re-run from backward) would then
take the CPU's ops instead of the target's, saving other tensors than the forward did
(``torch.utils.checkpoint`` raises).  The handler runs the autograd engine itself with the
mode pushed again (``torch.autograd.backward``'s own steps, after its torch-function check).
"""

from __future__ import annotations

import inspect

import torch
from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
from torch.autograd.graph import _engine_run_backward
from torch.overrides import TorchFunctionMode

from estimator import corrections

_BACKWARD = (torch.Tensor.backward, torch.autograd.backward)


class Substitutions(TorchFunctionMode):
    def __init__(self, spec) -> None:
        super().__init__()
        self.spec = spec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BACKWARD:
            return self._backward(func, args, kwargs)
        sub = corrections.substitution(self.spec.device, func)
        if sub is not None:
            result = sub(self.spec, func, args, kwargs)
            if result is not NotImplemented:
                return result
        return func(*args, **kwargs)

    def _backward(self, func, args, kwargs) -> None:
        """``Tensor.backward`` / ``torch.autograd.backward`` with this mode active."""
        bound = inspect.signature(func).bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        tensors, grads = (a["self"], a["gradient"]) if func is torch.Tensor.backward else (a["tensors"], a["grad_tensors"])
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        inputs = a["inputs"]
        inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        create = a["create_graph"]
        retain = create if a["retain_graph"] is None else a["retain_graph"]
        with self:
            grads_ = _make_grads(tensors, _tensor_or_tensors_to_tuple(grads, len(tensors)), is_grads_batched=False)
            _engine_run_backward(tensors, grads_, retain, create, inputs, allow_unreachable=True, accumulate_grad=True)
