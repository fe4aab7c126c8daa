"""Recurrent-network corrections (CPU kernels).

Only ``nn.LSTM`` reaches a fused CPU kernel: ``aten.mkldnn_rnn_layer`` (one layer, one
direction) and ``aten.mkldnn_rnn_layer_backward``, implemented with oneDNN in
aten/src/ATen/native/mkldnn/RNN.cpp.  ``nn.GRU`` / ``nn.RNN`` decompose into ordinary aten ops
on CPU and need nothing here.

Sizes follow oneDNN 3.x as bundled with torch 2.13 CPU:
src/cpu/rnn/rnn_utils.hpp ``set_conf`` / ``set_workspace_sizes`` (leading dimensions, buffer
sizes), src/cpu/rnn/rnn_utils.cpp ``set_offsets`` (each sub-buffer starts on a 4096-byte page;
``get_good_ld`` pads a leading dimension to a cache line and avoids multiples of 256).
Measured with the profiler's allocator events, one op at a time
(``torch.profiler.profile(profile_memory=True)``, events inside ``aten::mkldnn_rnn_layer``):
48 of 51 fp32 sequences (T in 1..64, B in 1..256, I/H in 16..512, grad on/off) match exactly.

The page rounding makes these numbers step functions of the batch size: they are exact for
concrete shapes only.  A symbolic batch raises ``SymbolicCaptureFailed`` (the LSTM kernel
itself cannot run with a symbolic batch either: at::native::lstm calls numel()).
"""

from __future__ import annotations

import torch

from estimator.corrections.registry import Fix, correction
from estimator.vocab.categories import Target
from estimator.vocab.errors import SymbolicCaptureFailed
from estimator.vocab.symbolic import as_expr

aten = torch.ops.aten

PAGE = 4096  # rnn_utils.cpp set_offsets: page-aligned sub-buffers
# oneDNN scratchpad registry (src/common/memory_tracking.hpp): key_rnn_space is booked with a
# 4096-byte perf alignment, and the small per-primitive arrays (ptr arrays, gemm bookkeeping)
# add a fixed tail.  Fitted: training 568 B, inference 856 B (+160 B more when I == H).
_SCRATCH_TAIL_TRAIN = PAGE + 568
_SCRATCH_TAIL_INFER = PAGE + 856
_SCRATCH_TAIL_INFER_SAME_WIDTH = 160


def _rnd_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _good_ld(dim: int, dsz: int) -> int:
    """rnn_utils::get_good_ld: round to a 64-byte line, then dodge multiples of 256 elements."""
    ld = _rnd_up(dim, 64 // dsz)
    return ld + 64 // dsz if ld % 256 == 0 else ld


def _offsets(parts, start: int = 0) -> int:
    off = start
    for size in parts:
        off = _rnd_up(off, PAGE) + size
    return off


def _ws_parts(T: int, B: int, I: int, H: int, dsz: int, csz: int, training: bool) -> list[int]:
    """set_workspace_sizes for one LSTM layer/direction (4 gates): gates, ht, states, c states,
    diff_states_layer, diff_states_iter, diff_states_iter_c, grid_comp (0 for LSTM)."""
    st_ld = _good_ld(max(H, I), dsz)
    diff_ld = _good_ld(max(I, H), 4)
    gates = T * B * _good_ld(4 * H, dsz) * dsz if training else 0
    ht = T * B * _good_ld(H, dsz) * dsz if training else 0
    states = 2 * (T + 1) * B * st_ld * dsz
    iter_c = 2 * (T + 1) * B * H * csz
    d_layer = 2 * (T + 1) * B * diff_ld * 4 if training else 0
    d_iter_c = 2 * (T + 1) * B * H * 4 if training else 0
    return [gates, ht, states, iter_c, d_layer, d_layer, d_iter_c, 0]


def workspace_bytes(T: int, B: int, I: int, H: int, dsz: int = 4, csz: int | None = None, grad_enabled: bool = True) -> int:
    """The 4th output of mkldnn_rnn_layer: ``at::empty(pd.workspace_desc().get_size(), kByte)``
    (RNN.cpp, mkldnn_rnn_layer) when GradMode is on, else an empty tensor."""
    if not grad_enabled:
        return 0
    return _offsets(_ws_parts(T, B, I, H, dsz, csz or dsz, True))


def _rnn_space(T: int, B: int, I: int, H: int, dsz: int, csz: int, training: bool, merge_gates: bool) -> int:
    """set_offsets' scratchpad (key_rnn_space).  Training: the ws_* buffers live in the workspace.
    Inference: states / c states live in the scratchpad, in front."""
    start = 0 if training else _offsets(_ws_parts(T, B, I, H, dsz, csz, False))
    n_it = T if merge_gates else 1
    gates = n_it * B * _good_ld(4 * H, 4) * 4  # scratch gates are f32
    ht = B * _good_ld(H, dsz) * dsz
    diff_ht = B * _good_ld(H, 4) * 4 if training else 0
    return _rnd_up(_offsets([gates, ht, diff_ht, 0], start), PAGE)


def forward_scratch(T: int, B: int, I: int, H: int, dsz: int = 4, grad_enabled: bool = True) -> int:
    """oneDNN scratchpad allocated and freed inside the forward op (via ideep, c10 allocator)."""
    if grad_enabled:
        # rnn_utils.hpp: merge the layer GEMM over all time steps when mb < 128
        return _rnn_space(T, B, I, H, dsz, dsz, True, B < 128) + _SCRATCH_TAIL_TRAIN
    tail = _SCRATCH_TAIL_INFER + (_SCRATCH_TAIL_INFER_SAME_WIDTH if I == H else 0)
    return _rnn_space(T, B, I, H, dsz, dsz, False, False) + tail


def backward_scratch(T: int, B: int, I: int, H: int, dsz: int = 4) -> int:
    return _rnn_space(T, B, I, H, dsz, dsz, True, True) + _SCRATCH_TAIL_TRAIN


def reordered_weights(I: int, H: int, dsz: int, grad_enabled: bool) -> list[int]:
    """ideep reorders the (4H, X) weights into the primitive's layout; alive during the op.
    Training: ldigo with a good leading dim; inference: brgemm-blocked ldgOi32o."""
    if grad_enabled:
        return [X * _good_ld(4 * H, dsz) * dsz for X in (I, H)]
    return [X * 4 * _rnd_up(H, 32) * dsz for X in (I, H)]


def _dims(t: torch.Tensor, what: str) -> tuple[int, ...]:
    dims = tuple(as_expr(s) for s in t.shape)
    if not all(isinstance(d, int) for d in dims):
        raise SymbolicCaptureFailed(
            f"{what}: oneDNN's LSTM workspace/scratchpad are page-rounded, so their size is a step "
            "function of the batch size (no polynomial in b)"
        )
    return dims


@correction(aten.mkldnn_rnn_layer, targets=Target.CPU)
def mkldnn_rnn_layer(args, kwargs, out) -> Fix:
    """aten.mkldnn_rnn_layer (RNN.cpp ``mkldnn_rnn_layer``): the meta kernel returns an empty
    workspace; the real one holds ``workspace_bytes`` when GradMode is on (the kernel checks
    ``at::GradMode::is_enabled()``, not its ``train`` argument).

    Allocation order inside the op (profiler): out, hy, cy, shuffled bias (4H), workspace,
    W_ih', W_hh', scratchpad, then frees.  Peak = outputs + bias + W_ih' + W_hh' + scratchpad.
    """
    inp, cx = args[0], args[6]
    hidden = args[10] if len(args) > 10 else kwargs["hidden_size"]
    T, B, I = _dims(inp, "mkldnn_rnn_layer")
    H = int(hidden)
    dsz, csz = inp.element_size(), cx.element_size()
    grad = torch.is_grad_enabled()
    bias = 4 * H * dsz  # RNN.cpp _shuffle_bias: bias_ih + bias_hh (zeros without biases)
    scratch = bias + sum(reordered_weights(I, H, dsz, grad)) + forward_scratch(T, B, I, H, dsz, grad)
    ws = workspace_bytes(T, B, I, H, dsz, csz, grad)
    return Fix(output_bytes={3: ws} if ws else {}, scratch=(scratch,))


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
    weights = sum(reordered_weights(I, H, dsz, True))
    # peak - (all outputs, clone included): the clone (4H*4) comes after the peak, the 4H*4
    # diff-bias buffer is alive at it: they cancel.
    scratch = pre + bias + diff_reorders + weights + backward_scratch(T, B, I, H, dsz)
    outputs = None
    if out[4] is out[3] or out[4].untyped_storage()._cdata == out[3].untyped_storage()._cdata:
        outputs = (*out[:4], out[3].clone(), *out[5:])
    return Fix(scratch=(scratch,), outputs=outputs)
