"""Functional collectives (``torch.ops._c10d_functional``), as a real run returns them.

DTensor's redistributions and tensor parallelism call the functional collectives: an op such
as ``all_gather_into_tensor`` returns a new output at once and ``wait_tensor(t)`` waits for it.
The real ``wait_tensor`` returns ``t`` itself
(torch/csrc/distributed/c10d/Functional.cpp ``wait_tensor``: ``c10d::unregister_work(tensor);
return tensor``); its fake kernel returns a new tensor of the same size, which the capture would
count as a second copy of every collective's output, alive as long as the first.
"""

from __future__ import annotations

import torch

from estimator.corrections.registry import fake_kernel
from estimator.vocab.categories import Target

_FUNCTIONAL = getattr(torch.ops, "_c10d_functional", None)
_WAIT = getattr(getattr(_FUNCTIONAL, "wait_tensor", None), "default", None)

if _WAIT is not None:  # a torch built without torch.distributed has no functional collectives
    @fake_kernel(_WAIT, targets=(Target.CPU, Target.CUDA))
    def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
        """The tensor waited for, itself; the real kernel runs too, for its side effect: it takes the
        collective's work out of c10d's registry (fake process groups register theirs as real ones
        do), which otherwise warns of "unwaited collective calls" when the process ends."""
        _WAIT(tensor)
        return tensor
