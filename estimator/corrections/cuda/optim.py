"""What CUDA changes in ``torch.optim``: the implementation chosen by default, and which state
stays in host memory.  Both are decided in Python (torch/optim/*.py), read from torch 2.13."""

from __future__ import annotations

import torch

from estimator.corrections.registry import host_state, optimizer_rule
from estimator.vocab.categories import Target

_HOSTED = ("step", "mu_product")  # 0-dim state the optimizers create with torch.tensor(...) on CPU
_ALWAYS_ON_DEVICE = (torch.optim.ASGD,)  # creates its step/eta/mu with device=p.device


@optimizer_rule(targets=Target.CUDA)
def foreach_by_default(spec, optimizer: torch.optim.Optimizer) -> None:
    """``_default_to_fused_or_foreach`` (torch/optim/optimizer.py): when neither ``foreach`` nor
    ``fused`` is given, an optimizer whose parameters are all on CUDA takes the foreach
    implementation (``foreach = not fused and all(p.device.type in
    _get_foreach_kernels_supported_devices())``); on CPU it takes the for-loop one.  Adam(W)
    keeps the for-loop when ``lr`` is a Tensor and not ``capturable`` (torch/optim/adam.py
    ``adam()``), and ``differentiable`` turns both off.  The fake parameters are CPU tensors,
    so the group is set the way it resolves on CUDA.  Memory: the foreach step allocates its
    temporaries for all parameters of a (device, dtype) group at once (Adam: ``_foreach_sqrt``
    of every ``exp_avg_sq``), the for-loop one parameter at a time.
    """
    for group in optimizer.param_groups:
        if "foreach" not in group or group["foreach"] is not None or group.get("fused"):
            continue
        if group.get("differentiable"):
            continue
        if isinstance(group.get("lr"), torch.Tensor) and not group.get("capturable"):
            continue
        group["foreach"] = True


@host_state(targets=Target.CUDA)
def scalar_state_on_host(optimizer, group: dict, key: str, value: torch.Tensor) -> bool:
    """"[special device hosting for step]" (torch/optim/adam.py ``_init_group``): unless
    ``capturable`` or ``fused``, the ``step`` counter (and NAdam's ``mu_product``) is created
    with ``torch.tensor(0.0, dtype=_get_scalar_dtype())``: a CPU tensor, no CUDA memory.  Same
    in adagrad, adadelta, adamax, nadam, radam, rmsprop, rprop; ASGD puts its scalars on the
    parameter's device."""
    if isinstance(optimizer, _ALWAYS_ON_DEVICE) or key not in _HOSTED or value.dim() != 0:
        return False
    return not group.get("capturable") and not group.get("fused")
