"""Upsampling and interpolation on the CPU: measured on the host.

The CPU kernels pick their loop by layout and size, and the vectorized channels-last loop
copies a contiguous (NCHW) input and output to channels-last and the result back:
``_use_vectorized_kernel_cond_2d`` in aten/src/ATen/native/cpu/UpSampleKernel.cpp takes it
when the input is channels-last with more than 3 channels, or when the output's
``H + W <= 128``, whatever the input's layout (``cpu_upsample_nearest_channels_last``:
``input.contiguous(channels_last)``, ``output.contiguous(channels_last)``).  A 2x nearest
upsample to 32 x 32 of a 16-channel NCHW map thus allocates an input-sized and an
output-sized copy besides its output (measured: 49,152 + 196,608 B at b = 3), which the meta
kernel does not; the backward kernels have their own paths.  The thresholds have changed
between releases, so every call is run on the host (``estimator.corrections.cpu.host``) and priced from
the allocator's events.
"""

from __future__ import annotations

import torch

from estimator.corrections.registry import measured
from estimator.vocab.categories import Target

aten = torch.ops.aten


@measured(
    aten.upsample_nearest1d, aten.upsample_nearest2d, aten.upsample_nearest3d,
    aten._upsample_nearest_exact1d, aten._upsample_nearest_exact2d, aten._upsample_nearest_exact3d,
    aten.upsample_linear1d, aten.upsample_bilinear2d, aten.upsample_bicubic2d, aten.upsample_trilinear3d,
    aten._upsample_bilinear2d_aa, aten._upsample_bicubic2d_aa,
    aten.upsample_nearest1d_backward, aten.upsample_nearest2d_backward, aten.upsample_nearest3d_backward,
    aten._upsample_nearest_exact1d_backward, aten._upsample_nearest_exact2d_backward,
    aten._upsample_nearest_exact3d_backward,
    aten.upsample_linear1d_backward, aten.upsample_bilinear2d_backward, aten.upsample_bicubic2d_backward,
    aten.upsample_trilinear3d_backward, aten._upsample_bilinear2d_aa_backward, aten._upsample_bicubic2d_aa_backward,
    targets=Target.CPU,
)
def resampling(args, kwargs, out) -> bool:
    """Every CPU upsampling call, forward and backward: its copies follow the layout and size."""
    return True
