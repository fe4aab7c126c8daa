"""Gradient clipping and ``zero_grad`` in a user's step (``report(step=fn)``), both targets.

``torch.nn.utils.clip_grad_norm_``, ``get_total_norm``, ``clip_grads_with_norm_`` and
``clip_grad_value_`` (torch/nn/utils/clip_grad.py, torch 2.13) group the gradients by device
and dtype and, with ``foreach=None``, take the foreach kernels where
``_has_foreach_support(grads, device)`` (torch/utils/_foreach_utils.py) holds: every gradient's
``type`` is ``torch.Tensor`` and the device is cpu, cuda, xpu, mtia or the private-use one.
A FakeTensor is not a ``torch.Tensor`` by that test, so the capture ran the per-tensor loops
(``linalg_vector_norm`` per gradient, ``mul_`` / ``clamp_`` per gradient) where real CPU and
CUDA gradients run ``_foreach_norm``, ``_foreach_mul_.Tensor`` and ``_foreach_clamp_min_`` /
``_foreach_clamp_max_``.  ``foreach_support`` (registry.py) makes the check answer as for the
real gradients inside these functions, on both targets.

What each branch allocates (ATen sources of torch 2.13's generation; CPU measured with the
profiler, ``tests/test_clip_grad.py``):

- CPU: ``_foreach_norm`` is ``foreach_tensor_norm_slow`` (ForeachOpsKernels.cpp): one
  ``linalg_vector_norm`` per tensor, the same n 0-dim outputs as the loop (measured: 4 B each
  for fp32 at ord 1, 2, inf, 3, 0; 2 B for bf16/fp16); ``_foreach_mul_`` / ``_foreach_clamp_*_``
  are per-tensor in-place ops.  Same bytes either way; the branch matters for the op sequence.
- CUDA: ``_foreach_norm``'s fast route books an fp32 per-chunk buffer besides its outputs
  (``cuda/foreach.py``); the in-place foreach ops allocate nothing
  (ForeachBinaryOpScalarTensor.cu, ForeachBinaryOpScalar.cu); ``torch.stack`` of the n norms
  and the ``vector_norm`` of that n-vector are a cat and a small reduction, as the fake run
  shows; ``total_norm + 1e-6`` keeps its wrapped number on the host.

``Optimizer.zero_grad(set_to_none=False)`` (torch/optim/optimizer.py) needs no entry: it reads
``self.defaults["foreach"]`` / ``["fused"]`` (no tensor-type test), so a fake run takes the
branch a real one takes: ``p.grad.zero_()`` per gradient, or ``_foreach_zero_`` per (device,
dtype) when the optimizer was built with ``foreach=True`` or ``fused=True``; both in place.
The CUDA optimizer rule (``cuda/optim.py``) sets ``foreach`` in the param groups, not in
``defaults``, so on CUDA too a default optimizer zeroes per tensor.  The gradients it keeps are
state before the next step (``step.user_state_tensors``, category GRADIENT, allocated before
the step in the CUDA allocator's replay like parameters and optimizer state).
"""

from __future__ import annotations

from torch.nn.utils import clip_grad

from estimator.corrections.registry import foreach_support
from estimator.vocab.categories import Target

# clip_grad_norm_ and clip_grad_norm call these two; get_total_norm / clip_grads_with_norm_
# are the same functions under their public names (torch/nn/utils/__init__.py).
CLIPPING = (clip_grad._get_total_norm, clip_grad._clip_grads_with_norm_, clip_grad.clip_grad_value_)

foreach_support(*CLIPPING, targets=(Target.CPU, Target.CUDA))
