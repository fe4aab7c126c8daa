"""Convolution corrections (CPU kernels, fp32/bf16 NCHW, 2-D, groups == 1).

Path choice: aten/src/ATen/native/Convolution.cpp ``ConvParams::use_mkldnn``: oneDNN when
``(strided | dilated | N >= 16 | kernel != 1x1 | threads > 1)`` and
``(groups > 1 | (kh > 3 and kw > 3) | N > 1 | N*C*H*W > 20480)``; else THNN
``slow_conv2d`` (aten/src/ATen/native/ConvolutionMM2d.cpp, im2col).  ``threads`` is
``torch.get_num_threads()`` at capture time: the estimate holds for that thread count.

oneDNN path (aten/src/ATen/native/mkldnn/Conv.cpp ``_mkldnn_convolution``,
``mkldnn_convolution_backward_input/_weights``, ``_mkldnn_convolution_transpose``): ideep
reorders the plain NCHW tensors into oneDNN's blocked layouts (channels padded to 16,
``nChw16c`` / ``OIhw16i16o``), computes into a blocked destination, and copies that into the
plain output.  oneDNN's scratchpad comes from the same CPU allocator; each booked entry is
its size + 128 bytes (src/common/memory_tracking.hpp, default alignment 128).  Entry sizes
come from the jit kernels' ``init_scratchpad`` (src/cpu/x64/jit_avx512_common_*conv*):
- rtus (1x1 convolution with stride: input reduced to unit stride): threads * Cin16 * Ho*Wo
- padded bias when Cout % 16 != 0: rup(Cout, 16) * dsz
Some scratchpad entries were only measured (profiler allocator events inside
``aten::convolution`` / ``aten::convolution_backward``, torch 2.13 CPU, AVX-512, 2 threads;
the shapes of the resnet/unet zoo models at b = 2, 8, 32): they are fitted constants below and
say so.
"""

from __future__ import annotations

import sympy
import torch

from estimator.categories import Target
from estimator.corrections.registry import NO_FIX, Fix, bind, correction
from estimator.errors import SymbolicCaptureFailed
from estimator.symbolic import as_expr

aten = torch.ops.aten

ALIGN = 128  # oneDNN scratchpad registry: each entry gets size + 128
# Measured, not derived (see module docstring): scratchpad of the strided backward-data
# kernel (also used by transposed convolution forward), constant over N, C, H, W measured.
STRIDED_BWD_DATA_SCRATCH = 61488
DECONV_FWD_SCRATCH = STRIDED_BWD_DATA_SCRATCH + ALIGN  # + the padded/bias entry


def _rup(x, m):
    if isinstance(x, int):
        return (x + m - 1) // m * m
    return sympy.ceiling(sympy.Rational(1, m) * x) * m  # only used on static sizes


def _is_symbolic(x) -> bool:
    return not isinstance(x, int)


def uses_mkldnn(N, C, H, W, kh, kw, strided, dilated, groups, threads) -> bool:
    """ConvParams::use_mkldnn for fp32 CPU (Convolution.cpp); N may be symbolic (then b >= 2)."""
    symbolic_n = _is_symbolic(N)
    first = strided or dilated or kh != 1 or kw != 1 or threads > 1
    if not first:
        if symbolic_n:
            raise SymbolicCaptureFailed("conv path choice (oneDNN vs THNN) depends on N >= 16 with one thread")
        first = N >= 16
    if not first:
        return False
    # symbolic N comes from the batch symbol, which is >= 2: N > 1 holds
    return groups > 1 or (kh > 3 and kw > 3) or symbolic_n or N > 1 or N * C * H * W > 20480


def _shape(t):
    return [as_expr(s) for s in t.shape]


@correction(aten.convolution, targets=Target.CPU)
def convolution(args, kwargs, out) -> Fix:
    """aten.convolution forward (Convolution.cpp -> mkldnn/Conv.cpp or ConvolutionMM2d.cpp).

    oneDNN, not transposed: allocations [s, in_r, w_r, y_b, -w_r, -in_r, -s, out, -y_b]:
      in_r = N*rup(Cin,16)*H*W*dsz (src reorder to nChw16c; skipped for the "first conv"
             kernel used when Cin < 16 and the kernel is not 1x1, which reads nchw directly)
      w_r  = rup(Cout,16) * (rup(Cin,16) if in_r else Cin) * kh*kw*dsz
      y_b  = N*rup(Cout,16)*Ho*Wo*dsz (blocked destination, copied into ``out``)
      s    = rtus (1x1 strided) and padded-bias scratchpad entries
    Transposed (deconv): [s, in_r, w_r, y_b, -w_r, -in_r, -s, out, tmp, -tmp, -y_b], y_b
      with Cout padded to 16 only when Cout >= 16 (measured), s = 61616 (measured).
    THNN slow_conv2d: [cols, out, -cols], cols = N*Cin*kh*kw*Ho*Wo*dsz (none for a 1x1,
      stride 1, no padding conv).
    Measured: 24 distinct zoo shapes x 3 batches x grad on/off, every sequence exact.
    """
    a = bind(aten.convolution.default, args, kwargs)
    x, w, bias = a["input"], a["weight"], a["bias"]
    if x.dim() != 4 or x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        return NO_FIX
    groups = int(a["groups"])
    if groups != 1:
        return NO_FIX  # not measured
    transposed = bool(a["transposed"])
    stride, padding, dilation = list(a["stride"]), list(a["padding"]), list(a["dilation"])
    N, Cin, H, W = _shape(x)
    o = tree_out(out)
    _, Cout, Ho, Wo = _shape(o)
    kh, kw = int(w.shape[2]), int(w.shape[3])
    dsz = x.element_size()
    out_bytes = N * Cout * Ho * Wo * dsz
    strided = any(s != 1 for s in stride)
    dilated = any(d != 1 for d in dilation)
    threads = torch.get_num_threads()
    if not uses_mkldnn(N, Cin, H, W, kh, kw, strided, dilated, groups, threads):
        if transposed:
            return NO_FIX  # slow_conv_transpose2d: not measured
        if kh == kw == 1 and not strided and all(p == 0 for p in padding):
            return NO_FIX
        return Fix(scratch=(N * Cin * kh * kw * Ho * Wo * dsz,))
    one_by_one = kh == 1 and kw == 1
    if transposed:
        in_r = N * _rup(Cin, 16) * H * W * dsz
        w_r = _rup(Cout, 16) * _rup(Cin, 16) * kh * kw * dsz
        y_b = N * (_rup(Cout, 16) if Cout >= 16 else Cout) * Ho * Wo * dsz
        s = DECONV_FWD_SCRATCH
        return Fix(scratch=(s + in_r + w_r + y_b - out_bytes, y_b + out_bytes))
    reorder_src = Cin >= 16 or one_by_one
    in_r = N * _rup(Cin, 16) * H * W * dsz if reorder_src else 0
    w_r = _rup(Cout, 16) * (_rup(Cin, 16) if reorder_src else Cin) * kh * kw * dsz
    y_b = N * _rup(Cout, 16) * Ho * Wo * dsz
    s = 0
    if one_by_one and strided:
        s += threads * _rup(Cin, 16) * Ho * Wo * dsz + ALIGN
    if bias is not None and Cout % 16:
        s += _rup(Cout, 16) * dsz + ALIGN
    return Fix(scratch=(s + in_r + w_r + y_b - out_bytes, y_b))


def _measured_bwd_weights_scratch(kh, kw, Cin, Cout, strided, bias) -> int:
    """backward_weights scratchpad entries measured on the zoo shapes, N-independent
    (fitted, not derived; the N-dependent reduction buffers of wider layers are not modelled)."""
    if kh == kw == 1 and not strided and _rup(Cin, 16) == 16 and _rup(Cout, 16) == 16 and Cin < 16:
        return 21888 + Cout * 4 if bias else 9344  # + the diff_bias buffer alive at the peak
    if kh == kw == 3 and _rup(Cout, 16) == 16:
        if Cin == 16:
            return 17600
        if Cin == 8 and Cout == 8:
            return 14592
        if Cin == 3:
            return 10112
    if kh == kw == 7 and Cin == 3 and _rup(Cout, 16) == 16:
        return 17792
    return 0


def _contiguous(t) -> bool:
    """Row-major contiguity from the stride expressions (no SymInt comparison, no guard)."""
    expected = 1
    for size, stride in reversed(list(zip(_shape(t), [as_expr(x) for x in t.stride()]))):
        if size != 1 and sympy.simplify(sympy.sympify(stride) - expected) != 0:
            return False
        expected = expected * size
    return True


def tree_out(out):
    return out[0] if isinstance(out, (tuple, list)) else out


@correction(aten.convolution_backward, targets=Target.CPU)
def convolution_backward(args, kwargs, out) -> Fix:
    """aten.convolution_backward on the oneDNN path (mkldnn/Conv.cpp
    ``mkldnn_convolution_backward``: backward_input, then backward_weights).

    backward_input: [go_r, w_r, gi_b, s_a, -s_a, -w_r, -go_r, gi, (tmp, -tmp,) -gi_b]
      go_r = N*rup(Cout,16)*Ho*Wo*4, w_r = rup(Cout,16)*rup(Cin,16)*kh*kw*4,
      gi_b = N*rup(Cin,16)*H*W*4; strided: s_a = 61488 (measured) and an extra copy of gi
      (tmp); go_r skipped when Ho*Wo == 1 (measured).
    backward_weights: [go_r, in_r, gw_b, s_b, -s_b, -in_r, -go_r, gw, -gw_b]
      in_r / gw_b as in the forward (src reorder, blocked weights); s_b = rtus for strided
      1x1; other s_b (<= 45 KB, per-thread reduction buffers) are not modelled.
    Peaks relative to "inputs and all outputs alive" are returned as scratch values.
    """
    grad_out, x, w = args[0], args[1], args[2]
    a = dict(zip(("bias_sizes", "stride", "padding", "dilation", "transposed", "output_padding", "groups", "output_mask"), args[3:]))
    a.update(kwargs)
    if x.dim() != 4 or x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        return NO_FIX
    groups = int(a["groups"])
    if groups != 1:
        return NO_FIX
    transposed = bool(a["transposed"])
    stride, dilation = list(a["stride"]), list(a["dilation"])
    mask = list(a["output_mask"])
    N, Cin, H, W = _shape(x)
    _, Cout, Ho, Wo = _shape(grad_out)
    kh, kw = int(w.shape[2]), int(w.shape[3])
    dsz = x.element_size()
    strided = any(s != 1 for s in stride)
    dilated = any(d != 1 for d in dilation)
    threads = torch.get_num_threads()
    if not uses_mkldnn(N, Cin, H, W, kh, kw, strided, dilated, groups, threads):
        return NO_FIX  # not measured
    if transposed:
        # weight (Cin, Cout, kh, kw) with Cin = grad_out's channels: grad_out is reordered
        # (blocked, channels padded to 16) once per pass and the first copy lives until the
        # op ends; measured peak = outputs + 2*go_r + in_r (ConvTranspose2d k2 s2 in the zoo).
        if not (mask[0] and mask[1]):
            return NO_FIX
        _, Cg, Hg, Wg = _shape(grad_out)
        go_r = N * (_rup(Cg, 16) if Cg >= 16 else Cg) * Hg * Wg * dsz  # as the deconv forward's y_b
        # a non-contiguous grad_out (e.g. a slice of torch.cat's gradient) is first copied by
        # .contiguous(); that copy lives until the op returns
        copy = 0 if _contiguous(grad_out) else N * Cg * Hg * Wg * dsz
        return Fix(scratch=(copy + go_r + N * Cin * H * W * dsz,))
    one_by_one = kh == 1 and kw == 1
    gi = N * Cin * H * W * dsz if mask[0] else 0
    gw = Cout * Cin * kh * kw * dsz if mask[1] else 0
    gb = Cout * dsz if len(mask) > 2 and mask[2] else 0
    total = gi + gw + gb
    scratch = []
    if mask[0]:
        spatial_one = isinstance(Ho, int) and isinstance(Wo, int) and Ho * Wo == 1
        go_r = 0 if (strided and spatial_one) else N * _rup(Cout, 16) * Ho * Wo * dsz
        w_r = _rup(Cout, 16) * _rup(Cin, 16) * kh * kw * dsz
        gi_b = N * _rup(Cin, 16) * H * W * dsz
        s_a = STRIDED_BWD_DATA_SCRATCH if strided else 0
        scratch.append(go_r + w_r + gi_b + s_a - total)
        scratch.append(gi_b + (gi if strided else 0) - (total - gi))
    if mask[1]:
        reorder_src = Cin >= 16 or one_by_one
        if reorder_src:  # blocked src, diff_dst and diff_weights
            go_r = N * _rup(Cout, 16) * Ho * Wo * dsz
            in_r = N * _rup(Cin, 16) * H * W * dsz
            gw_b = _rup(Cout, 16) * _rup(Cin, 16) * kh * kw * dsz
        elif Cin % 8 == 0:  # measured (Cin = 8): plain copies of diff_dst and src
            go_r = N * Cout * Ho * Wo * dsz
            in_r = N * Cin * H * W * dsz
            gw_b = Cout * Cin * kh * kw * dsz
        else:  # "first conv" kernel (Cin = 3): src read as is, diff_dst blocked
            go_r = N * _rup(Cout, 16) * Ho * Wo * dsz
            in_r = 0
            gw_b = _rup(Cout, 16) * Cin * kh * kw * dsz
        s_b = threads * _rup(Cin, 16) * Ho * Wo * dsz + ALIGN if (one_by_one and strided) else 0
        s_b += _measured_bwd_weights_scratch(kh, kw, Cin, Cout, strided, bool(gb))
        scratch.append(go_r + in_r + gw_b + s_b - (total - gi))  # gi already allocated
        scratch.append(gw_b - gb)
    return Fix(scratch=tuple(scratch))
