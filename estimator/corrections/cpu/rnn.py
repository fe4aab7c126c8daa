"""Recurrent-network corrections (CPU kernels).

Only ``nn.LSTM`` reaches a fused CPU kernel: ``aten.mkldnn_rnn_layer`` (one layer, one
direction) and ``aten.mkldnn_rnn_layer_backward``, implemented with oneDNN in
aten/src/ATen/native/mkldnn/RNN.cpp.  ``nn.GRU`` / ``nn.RNN`` decompose into ordinary aten ops
on CPU and need nothing here.

The forward is measured on the host (``estimator.corrections.cpu.host``), in the grad mode the
step runs it in: oneDNN picks its implementation and books its scratchpad by the host's ISA and
the batch (an inference sequence of one row books other buffers than one of two rows: sizes
fitted on rows of two and more were up to 8 KiB low at b = 1).

The backward takes the forward's workspace as an input, which a zero-filled stand-in cannot
give, so it is modelled, from oneDNN 3.x as bundled with torch 2.13 CPU:
src/cpu/rnn/rnn_utils.hpp ``set_conf`` (leading dimensions, buffer sizes), src/cpu/rnn/rnn_utils.cpp
``set_offsets`` (each sub-buffer starts on a 4096-byte page; ``get_good_ld`` pads a leading
dimension to a cache line and avoids multiples of 256), plus a fixed tail of the scratchpad
registry measured on an AVX-512 host (``_SCRATCH_TAIL_TRAIN``) that the validators check on
AVX-512 and AVX2 (``python -m validators``: the zoo's rnn and lstm_lm, train, exact on both).

The page rounding makes these numbers step functions of the batch size: they are exact for
concrete shapes only.  A symbolic batch raises ``SymbolicCaptureFailed`` (the LSTM kernel
itself cannot run with a symbolic batch either: at::native::lstm calls numel()).
"""

from __future__ import annotations

import torch

from estimator.corrections.registry import Fix, correction, measured
from estimator.vocab.categories import Target
from estimator.vocab.errors import SymbolicCaptureFailed
from estimator.vocab.symbolic import as_expr

aten = torch.ops.aten

PAGE = 4096  # rnn_utils.cpp set_offsets: page-aligned sub-buffers
# oneDNN scratchpad registry (src/common/memory_tracking.hpp): key_rnn_space is booked with a
# 4096-byte perf alignment, and the small per-primitive arrays (ptr arrays, gemm bookkeeping)
# add a fixed tail: 568 B measured for the backward (the module's docstring says where it holds).
_SCRATCH_TAIL_TRAIN = PAGE + 568


def _rnd_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _good_ld(dim: int, dsz: int) -> int:
    """rnn_utils::get_good_ld: round to a 64-byte line, then dodge multiples of 256 elements."""
    ld = _rnd_up(dim, 64 // dsz)
    return ld + 64 // dsz if ld % 256 == 0 else ld


def _offsets(parts) -> int:
    off = 0
    for size in parts:
        off = _rnd_up(off, PAGE) + size
    return off


def _rnn_space(T: int, B: int, H: int, dsz: int) -> int:
    """set_offsets' scratchpad (key_rnn_space) of a training primitive, whose ws_* buffers live in
    the workspace: the f32 scratch gates of every time step (the layer GEMM merged over them),
    ht and diff_ht, each on its own page."""
    gates = T * B * _good_ld(4 * H, 4) * 4  # scratch gates are f32
    ht = B * _good_ld(H, dsz) * dsz
    diff_ht = B * _good_ld(H, 4) * 4
    return _rnd_up(_offsets([gates, ht, diff_ht, 0]), PAGE)


def backward_scratch(T: int, B: int, H: int, dsz: int = 4) -> int:
    return _rnn_space(T, B, H, dsz) + _SCRATCH_TAIL_TRAIN


def reordered_weights(I: int, H: int, dsz: int) -> list[int]:
    """ideep reorders the (4H, X) weights into the training primitive's ldigo layout with a good
    leading dimension; alive during the op."""
    return [X * _good_ld(4 * H, dsz) * dsz for X in (I, H)]


def _dims(t: torch.Tensor, what: str) -> tuple[int, ...]:
    dims = tuple(as_expr(s) for s in t.shape)
    if not all(isinstance(d, int) for d in dims):
        raise SymbolicCaptureFailed(
            f"{what}: oneDNN's LSTM workspace/scratchpad are page-rounded, so their size is a step "
            "function of the batch size (no polynomial in b)"
        )
    return dims


@measured(aten.mkldnn_rnn_layer, targets=Target.CPU, grad_mode=True)
def mkldnn_rnn_layer(args, kwargs, out) -> bool:
    """aten.mkldnn_rnn_layer (RNN.cpp ``mkldnn_rnn_layer``), measured: the meta kernel returns an
    empty workspace; the real one holds ``pd.workspace_desc().get_size()`` bytes when GradMode is
    on (the kernel checks ``at::GradMode::is_enabled()``, not its ``train`` argument), a shuffled
    bias, the weights reordered into the primitive's layout and oneDNN's scratchpad."""
    _dims(args[0], "mkldnn_rnn_layer")
    return True


@correction(aten.mkldnn_rnn_layer_backward, targets=Target.CPU)
def mkldnn_rnn_layer_backward(args, kwargs, out) -> Fix:
    """aten.mkldnn_rnn_layer_backward (RNN.cpp ``mkldnn_rnn_layer_backward``).

    Outputs: (diff_x, diff_w_ih, diff_w_hh, diff_b, diff_b2, diff_hx, diff_cx).  The meta kernel
    returns diff_b twice as one tensor (sometimes: not on a fake-tensor cache hit); the real one
    returns ``diff_b.clone()`` as the second.  The fix makes it a clone every time: with one
    tensor, AccumulateGrad copies the first bias gradient instead of stealing it, and whether
    it does depended on the cache.

    Allocation order (profiler): grad_output.contiguous() when it is not, zeros for an
    undefined grad_hy / grad_cy (B*H*4 each), shuffled bias (4H*dsz), the six outputs,
    diff-weight reorders 4H*good_ld(X)*4 for X in (I, H) whose good_ld differs from X, the
    forward-format weights W' (as in training forward), a 4H*4 diff-bias buffer, the
    scratchpad; frees; then the diff_b clone.
    """
    inp, grad_output, grad_hy, grad_cy = args[0], args[10], args[11], args[12]
    hidden = args[15] if len(args) > 15 else kwargs["hidden_size"]
    T, B, I = _dims(inp, "mkldnn_rnn_layer_backward")
    H = int(hidden)
    dsz = inp.element_size()
    pre = 0
    if grad_output is not None and not grad_output.is_contiguous():
        pre += T * B * H * 4
    pre += sum(B * H * 4 for g in (grad_hy, grad_cy) if g is None)
    bias = 4 * H * dsz
    diff_reorders = sum(4 * H * _good_ld(X, 4) * 4 for X in (I, H) if _good_ld(X, 4) != X)
    weights = sum(reordered_weights(I, H, dsz))
    # peak - (all outputs, clone included): the clone (4H*4) comes after the peak, the 4H*4
    # diff-bias buffer is alive at it: they cancel.
    scratch = pre + bias + diff_reorders + weights + backward_scratch(T, B, H, dsz)
    outputs = None
    if out[4] is out[3] or out[4].untyped_storage()._cdata == out[3].untyped_storage()._cdata:
        outputs = (*out[:4], out[3].clone(), *out[5:])
    return Fix(scratch=(scratch,), outputs=outputs)
