"""The torch-function mode that runs a target's substitutes while capturing (``@substitute``
entries of ``registry.py``).

Where the target runs other aten ops than the CPU would (CUDA attention backends, the fused
dropout kernel), the registry holds a substitute that calls the target's ops on the fake CPU
tensors; this mode routes the calls to it.  Not installed for targets without substitutes.
It lives with the registry (not in ``estimator.capture``) because substitutes use it too: one
that must see the torch functions called inside the function it replaces runs that function
with the mode pushed again (``run_inside``).

Backward stays inside the mode: ``handle_torch_function`` pops a mode while its handler runs,
so ``loss.backward()`` passed through as it is would run the whole backward without it -- and
the recomputation of checkpointed modules (their forward, re-run from backward) would then
take the CPU's ops instead of the target's, saving other tensors than the forward did
(``torch.utils.checkpoint`` raises).  The handler runs the autograd engine itself with the
mode pushed again (``torch.autograd.backward``'s and ``torch.autograd.grad``'s own steps, after
their torch-function check: a step computing its gradients with ``grad``, and a pipeline stage's
input gradients, ``torch.distributed.pipelining``'s ``stage_backward_input``, recompute too).
``BackwardInside`` is that behaviour; the CUDA autocast emulation's mode (``cuda/autocast.py``)
shares it, for the same recomputation.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
from torch.autograd.graph import GradientEdge, _engine_run_backward
from torch.overrides import TorchFunctionMode, is_tensor_like

from estimator.corrections.patches import patched_all
from estimator.corrections.registry import fast_path_checks_enter, fast_path_checks_exit, substitution

_BACKWARD = (torch.Tensor.backward, torch.autograd.backward)
_GRAD = torch.autograd.grad  # (a user step's phases replace the module's name with a wrapper)


class BackwardInside(TorchFunctionMode):
    """A torch-function mode that stays active through ``backward()`` and ``torch.autograd.grad``
    (the module docstring); ``handle`` answers every other torch function."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        base = getattr(func, "__wrapped__", func)  # (a user step's phases wrap backward())
        if base in _BACKWARD:
            return self._backward(base, args, kwargs)
        if base is _GRAD:
            return self._grad(base, args, kwargs)
        return self.handle(func, args, kwargs)

    def handle(self, func, args: tuple, kwargs: dict):
        return func(*args, **kwargs)

    def _backward(self, func, args, kwargs) -> None:
        """``Tensor.backward`` / ``torch.autograd.backward`` with this mode active."""
        bound = inspect.signature(func).bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        tensors, grads = (a["self"], a["gradient"]) if func is _BACKWARD[0] else (a["tensors"], a["grad_tensors"])
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        inputs = a["inputs"]
        inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        create = a["create_graph"]
        retain = create if a["retain_graph"] is None else a["retain_graph"]
        with self:
            grads_ = _make_grads(tensors, _tensor_or_tensors_to_tuple(grads, len(tensors)), is_grads_batched=False)
            _engine_run_backward(tensors, grads_, retain, create, inputs, allow_unreachable=True, accumulate_grad=True)


    def _grad(self, func, args, kwargs):
        """``torch.autograd.grad`` with this mode active (its steps after the torch-function check;
        a batched one, ``is_grads_batched``, runs as it is)."""
        a = inspect.signature(func).bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        if a["is_grads_batched"]:
            return func(*args, **kwargs)

        def one_or_many(x) -> tuple:
            return (x,) if is_tensor_like(x) or isinstance(x, GradientEdge) else tuple(x)

        outputs, inputs = one_or_many(a["outputs"]), a["inputs"]
        keys = list(inputs) if type(inputs) is dict else None
        inputs = tuple(inputs.values()) if keys is not None else one_or_many(inputs)
        allow_unused = a["materialize_grads"] if a["allow_unused"] is None else a["allow_unused"]
        create = a["create_graph"]
        retain = create if a["retain_graph"] is None else a["retain_graph"]
        with self:
            grads = _make_grads(outputs, _tensor_or_tensors_to_tuple(a["grad_outputs"], len(outputs)),
                                is_grads_batched=False)
            result = _engine_run_backward(outputs, grads, retain, create, inputs, allow_unused, accumulate_grad=False)
            if a["materialize_grads"]:
                result = tuple(torch.zeros_like(i, requires_grad=create) if r is None else r
                               for r, i in zip(result, inputs))
        return result if keys is None else dict(zip(keys, result))


class Substitutions(BackwardInside):
    def __init__(self, spec) -> None:
        super().__init__()
        self.spec = spec

    def __enter__(self):
        # The native fast-path checks see the fake tensors as the real ones (registry.fast_path).
        fast_path_checks_enter(self.spec.device)
        try:
            return super().__enter__()
        except BaseException:
            fast_path_checks_exit()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            fast_path_checks_exit()

    def handle(self, func, args: tuple, kwargs: dict):
        sub = substitution(self.spec.device, func)
        if sub is not None:
            result = sub(self.spec, func, args, kwargs)
            if result is not NotImplemented:
                return result
        return func(*args, **kwargs)


def _no_torch_function(*_args) -> bool:
    return False


_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


def run_inside(spec, func, args, kwargs):
    """Run the ``torch.nn.functional`` function ``func`` with the substitution mode of ``spec``
    active, so that the torch functions it calls get their substitutes.

    A Python function of ``torch.nn.functional`` that starts with ``if
    has_torch_function(...): return handle_torch_function(...)`` (``multi_head_attention_forward``;
    ``has_torch_function_unary`` in ``interpolate``) is dispatched to the mode, which calls it with
    the mode popped: the functions it calls would then run unsubstituted.  Here its body runs with
    a mode pushed again and its own re-dispatch checks off (``_CHECKS``, the names such functions
    look up in their module)."""
    with patched_all((F, name, _no_torch_function) for name in _CHECKS), Substitutions(spec):
        return func(*args, **kwargs)
