"""Per-op knowledge by target, one registry (``registry.py``); the entries live by target and
op family: ``cpu/`` (measured on the host: convolution, batch norm, flash attention,
low-precision matmuls and reductions; oneDNN RNN, losses), ``cuda/`` (attention backends,
fused kernels, pooling copies, cuDNN RNN, autocast lists, optimizer defaults), ``shapes.py``
(fake kernels that would fix a symbolic size, for every target), ``composite.py`` (C++
composites whose branch for tensor subclasses, fake tensors included, differs in memory from the
real tensors' one, for every target).

Importing this package registers every entry.
"""

from estimator.corrections import composite, shapes  # noqa: F401  (registers the entries)
from estimator.corrections import grouped_mm, masks  # noqa: F401
from estimator.corrections import fastpath  # noqa: F401  (native MHA / encoder fast paths)
from estimator.corrections import clip  # noqa: F401  (clip_grad_* take the foreach branch of real tensors)
from estimator.corrections import collectives  # noqa: F401  (functional collectives' wait returns its tensor)
from estimator.corrections import complex  # noqa: F401  (abs of a complex tensor: a complex temporary)
from estimator.corrections import packed  # noqa: F401  (pack_padded_sequence and the packed RNNs)
from estimator.corrections.cpu import attention as cpu_attention  # noqa: F401
from estimator.corrections.cpu import collectives as gloo  # noqa: F401  (gloo's buffers)
from estimator.corrections.cpu import conv, loss, matmul, norm, reduce, resample, rnn  # noqa: F401
from estimator.corrections.cpu import foreach as cpu_foreach  # noqa: F401  (a wrapped number per tensor)
from estimator.corrections.cuda import attention_substitute, attention_workspaces  # noqa: F401  (SDPA)
from estimator.corrections.cuda import blas, kernels, optim  # noqa: F401
from estimator.corrections.cuda import foreach  # noqa: F401  (_foreach_norm's per-chunk buffer)
from estimator.corrections.cuda import pooling  # noqa: F401  (pooling kernels' layout copies)
from estimator.corrections.cuda import rnn as cuda_rnn  # noqa: F401
from estimator.corrections.registry import (
    NO_FIX,
    Fix,
    apply_model_rules,
    apply_optimizer_rules,
    bind,
    capture_contexts,
    correction,
    fake_kernel,
    fake_kernel_for,
    has_substitutes,
    host_state,
    in_managed_memory,
    lookup,
    managed_state,
    model_rule,
    on_host,
    optimizer_rule,
    registered,
    substitute,
    substitutes,
    substitution,
    while_capturing,
)

__all__ = [
    "NO_FIX", "Fix", "apply_model_rules", "apply_optimizer_rules", "bind", "capture_contexts", "correction",
    "fake_kernel", "fake_kernel_for", "has_substitutes", "host_state", "in_managed_memory", "lookup", "managed_state",
    "model_rule", "on_host", "optimizer_rule", "registered", "substitute", "substitutes", "substitution",
    "while_capturing",
]
