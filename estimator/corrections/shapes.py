"""Fake kernels and C++ composites that specialize a symbolic size the real kernel does not depend
on, replaced by symbolic-friendly equivalents (every target: the capture is the same fake run)."""

from __future__ import annotations

import torch
import torch._refs
import torch.nn.functional as F
from torch._prims_common import suggest_memory_format

from estimator.corrections.mode import run_inside
from estimator.corrections.registry import fake_kernel, substitute
from estimator.vocab.categories import Target

aten = torch.ops.aten


@fake_kernel(aten.constant_pad_nd.default, targets=(Target.CPU, Target.CUDA))
def constant_pad_nd(self, pad, value=0):
    """``F.pad(x, ..., mode="constant")``: the C++ ``constant_pad_nd`` (aten/src/ATen/native/
    PadNd.cpp) reads ``self.sizes()`` as integers, so on fake tensors every symbolic dim becomes
    a constant (torch 2.13: ``Eq(b, hint)``, which turned Hugging Face causal-LM losses,
    ``F.pad(labels, (0, 1), value=-100)``, into concrete captures).  ``torch._refs.constant_pad_nd``
    computes the same output with symbolic sizes.  Memory is the same: both allocate the output
    once (``at::empty`` + fill + a narrowed copy; the ref: ``torch.full`` + a narrowed copy)."""
    return torch._refs.constant_pad_nd(self, pad, value)


# ``F.interpolate`` calls the ``.vec`` overloads (``torch._C._nn.upsample_*(input, output_size,
# [align_corners,] scale_factors)``), CompositeImplicitAutograd in aten/src/ATen/native/UpSample*.cpp:
# ``osize = compute_output_size(input.sizes(), output_size, scale_factors)`` (UpSample.cpp) reads
# every size as an integer, so on fake tensors the batch became a constant (``Eq(b, hint)``: every
# U-Net, FPN and diffusion model's upsampling made its capture concrete).  The substitute runs the
# same composite with the sizes as they are: ``compute_output_size``'s
# ``c10::checked_convert<int64_t>(input_size[i + 2] * scale_factors[i])`` (truncation), then the
# ``.default`` overload the composite calls, with ``get_scale_value``'s per-dim scales.  The ops
# recorded and what autograd saves are the real run's.
_NEAREST = ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
            "_upsample_nearest_exact2d", "_upsample_nearest_exact3d")
_INTERPOLATING = ("upsample_linear1d", "upsample_bilinear2d", "upsample_bicubic2d", "upsample_trilinear3d",
                  "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa")  # these take align_corners
_UPSAMPLE = {getattr(torch._C._nn, name): (getattr(aten, name).default, name in _INTERPOLATING)
             for name in _NEAREST + _INTERPOLATING}


@substitute(F.interpolate, targets=(Target.CPU, Target.CUDA))
def interpolate(spec, func, args, kwargs):
    """``F.interpolate`` re-dispatches to the substitution mode (``has_torch_function_unary``), which
    would run it with the mode popped: its ``torch._C._nn.upsample_*`` call would not reach
    ``upsample_vec``.  ``run_inside`` runs it with the mode active."""
    return run_inside(spec, func, args, kwargs)


@substitute(*_UPSAMPLE, targets=(Target.CPU, Target.CUDA))
def upsample_vec(spec, func, args, kwargs):
    """The ``.vec`` call of ``func`` as its composite computes it, without reading the batch size
    (above); any other call (the ``.default`` signature, a symbolic spatial size, both or neither
    of ``output_size`` and ``scale_factors``) runs as it is."""
    op, align = _UPSAMPLE[func]
    names = ("input", "output_size", "align_corners", "scale_factors") if align else ("input", "output_size",
                                                                                      "scale_factors")
    if len(args) > len(names) or set(kwargs) - set(names):
        return NotImplemented
    bound = dict(zip(names, args), **kwargs)
    x, output_size, scales = bound.get("input"), bound.get("output_size"), bound.get("scale_factors")
    if not isinstance(x, torch.Tensor) or (output_size is None) == (scales is None) or (
            scales is not None and not isinstance(scales, (list, tuple))):
        return NotImplemented
    spatial = x.shape[2:]
    if not all(isinstance(s, int) for s in spatial) or len(output_size or scales) != len(spatial):
        return NotImplemented
    osize = list(output_size) if output_size is not None else [int(s * f) for s, f in zip(spatial, scales)]
    per_dim = list(scales) if scales is not None else [None] * len(spatial)
    return op(x, osize, *((bound["align_corners"],) if align else ()), *per_dim)


@fake_kernel(*(getattr(aten, f"{name}_backward").default for name in _INTERPOLATING), targets=(Target.CPU, Target.CUDA))
def upsample_interpolating_backward(grad_output, output_size, input_size, *args, **kwargs):
    """The interpolating upsamples' backward: its meta kernel is the C++ structured one
    (``TORCH_META_FUNC(upsample_bilinear2d_backward)`` in UpSampleBilinear2d.cpp and the like),
    which reads ``input_size`` as ``int[]`` and asserts on a symbolic batch ("Expected IntList but
    got GenericList"), so every model that upsampled bilinearly got a concrete capture.  Its output,
    as the meta sets it: ``grad_input`` of ``input_size`` in ``grad_output``'s suggested memory
    format; nothing else is allocated."""
    return torch.empty(input_size, dtype=grad_output.dtype, device=grad_output.device,
                       memory_format=suggest_memory_format(grad_output))
