"""Per-op knowledge by target, one registry (``registry.py``); the entries live by target and
op family: ``cpu/`` (oneDNN convolution and RNN, CPU batch norm), ``cuda/`` (attention
backends, fused kernels, optimizer defaults), ``loss.py`` (kernels shared by both).

Importing this package registers every entry.
"""

from estimator.corrections.registry import (
    NO_FIX,
    Fix,
    apply_optimizer_rules,
    bind,
    correction,
    has_substitutes,
    host_state,
    lookup,
    on_host,
    optimizer_rule,
    registered,
    substitute,
    substitutes,
    substitution,
)
from estimator.corrections import loss  # noqa: F401,E402  (registers the entries)
from estimator.corrections.cpu import conv, norm, rnn  # noqa: F401,E402
from estimator.corrections.cuda import attention, kernels, optim, rnn as cuda_rnn  # noqa: F401,E402

__all__ = [
    "NO_FIX", "Fix", "apply_optimizer_rules", "bind", "correction", "has_substitutes", "host_state", "lookup",
    "on_host", "optimizer_rule", "registered", "substitute", "substitutes", "substitution",
]
