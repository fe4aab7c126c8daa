"""Run a target's torch-function substitutes while capturing (``estimator.corrections``).

Where the target runs other aten ops than the CPU would (CUDA attention backends, the fused
dropout kernel), the registry holds a substitute that calls the target's ops on the fake CPU
tensors; this mode routes the calls to it.  Not installed for targets without substitutes.
"""

from __future__ import annotations

from torch.overrides import TorchFunctionMode

from estimator import corrections


class Substitutions(TorchFunctionMode):
    def __init__(self, spec) -> None:
        super().__init__()
        self.spec = spec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sub = corrections.substitution(self.spec.device, func)
        if sub is not None:
            result = sub(self.spec, func, args, kwargs)
            if result is not NotImplemented:
                return result
        return func(*args, **kwargs)
