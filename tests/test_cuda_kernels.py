"""The CUDA target's kernel entries (estimator/corrections/cuda/kernels.py, pooling.py, rnn.py)
without a GPU: exact byte numbers on tiny modules (arithmetic in the comments, derived from the
PyTorch sources cited in the entries' docstrings), and the CPU target unchanged for the same
modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from estimator import corrections
from estimator.capture import steps
from estimator.capture.records import StepSpec
from estimator.capture.trace import capture
from estimator.corrections import NO_FIX, lookup, packed
from estimator.corrections.cuda import kernels, rnn
from estimator.vocab.categories import Mode, Phase, Target
from estimator.vocab.gpus import resolve_gpu
from estimator.vocab.target import TargetSpec

aten = torch.ops.aten
CPU = TargetSpec()
CUDA = TargetSpec(Target.CUDA, resolve_gpu("H100"))


def _ops(model, sample, target, mode=Mode.TRAIN, loss=steps.default_loss):
    """[(op name, phase, [allocated bytes], [scratch bytes])] of one concrete capture."""
    optimizer = steps.optimizer_factory("sgd") if mode is Mode.TRAIN else None
    raw = capture(model, sample, StepSpec(mode, optimizer, loss, target), batch=sample.shape[0], symbolic=False)
    return [
        (op.name, op.phase, [raw.storages[k].nbytes(0) for k in op.allocs], [s(0) for s in op.scratch])
        for op in raw.ops
    ]


def _find(ops, name):
    return [op for op in ops if op[0] == name]


def _forward_backward(ops):
    """The forward and backward ops with their allocations; scratch left out: the CPU target
    prices the 0-dim tensor a Python number is wrapped in (MeanBackward's ``div.Scalar``: 12 B),
    which on CUDA stays in host memory."""
    return [op[:3] for op in ops if op[1] is not Phase.OPTIMIZER]


# -- dropout ---------------------------------------------------------------------------------
def test_training_dropout_is_fused_with_a_bool_mask_on_cuda():
    model, x = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1)), torch.randn(4, 8)
    cpu, gpu = _ops(model, x, CPU), _ops(model, x, CUDA)
    # CPU _dropout_impl: noise = empty_like(input) (4*16*4 = 256 B, saved by mul), out = mul (256 B)
    assert _find(cpu, "aten.empty_like.default")[0][2] == [256]
    assert _find(cpu, "aten.mul.Tensor")[0][2] == [256]
    assert not _find(cpu, "aten.native_dropout.default")
    # CUDA native_dropout: out (256 B) + bool mask (4*16*1 = 64 B); backward native_dropout_backward
    assert _find(gpu, "aten.native_dropout.default")[0][2] == [256, 64]
    assert _find(gpu, "aten.native_dropout_backward.default")[0][2] == [256]
    assert not _find(gpu, "aten.empty_like.default")


@pytest.mark.parametrize("module", [nn.Dropout(0.1, inplace=True), nn.Dropout(0.0), nn.Dropout(1.0),
                                    nn.Dropout1d(0.1), nn.AlphaDropout(0.1), nn.FeatureAlphaDropout(0.1)])
def test_unfused_dropouts_are_the_same_on_both_targets(module):
    # dropout_ (inplace), p = 0 / 1, feature and alpha dropouts: _dropout_impl on every device
    model, x = nn.Sequential(nn.Linear(8, 16), module), torch.randn(4, 8)
    cpu, gpu = _ops(model, x, CPU), _ops(model, x, CUDA)
    assert _forward_backward(cpu) == _forward_backward(gpu)
    assert not _find(gpu, "aten.native_dropout.default")


def test_eval_dropout_is_unchanged():
    model, x = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1)), torch.randn(4, 8)
    assert _ops(model, x, CPU, Mode.INFERENCE) == _ops(model, x, CUDA, Mode.INFERENCE)


def test_functional_and_torch_dropout_are_substituted():
    def loss(out, sample):
        return torch.dropout(F.dropout(out, 0.5, training=True), 0.5, True).mean()

    gpu = _ops(nn.Linear(8, 16), torch.randn(4, 8), CUDA, loss=loss)
    assert [op[2] for op in _find(gpu, "aten.native_dropout.default")] == [[256, 64], [256, 64]]


# -- RMSNorm / LayerNorm ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype, out_bytes, dw_bytes", [(torch.float32, 256, 64), (torch.bfloat16, 128, 32)])
def test_rms_norm_is_one_fused_op_on_cuda(dtype, out_bytes, dw_bytes):
    model, x = nn.Sequential(nn.Linear(8, 16), nn.RMSNorm(16)).to(dtype), torch.randn(4, 8, dtype=dtype)
    gpu, cpu = _ops(model, x, CUDA), _ops(model, x, CPU)
    # _fused_rms_norm_cuda: Y (4*16*itemsize) + rstd (4 rows, fp32 acc type: 16 B)
    assert _find(gpu, "aten._fused_rms_norm.default")[0][2] == [out_bytes, 16]
    # backward: dX (like X) + dgamma (16 * itemsize); M = 4 rows: no partial-sum buffers
    assert _find(gpu, "aten._fused_rms_norm_backward.default")[0][2:] == ([out_bytes, dw_bytes], [])
    assert not any(op[0].startswith("aten.pow") for op in gpu if op[1] is Phase.FORWARD)
    # CPU: rms_norm_composite (pow, mean, rsqrt, mul...), no fused op
    assert not _find(cpu, "aten._fused_rms_norm.default")
    assert _find(cpu, "aten.pow.Tensor_Scalar")


@pytest.mark.filterwarnings("ignore:Mismatch dtype")
def test_rms_norm_with_a_weight_of_another_dtype_stays_composite():
    norm = nn.RMSNorm(16)  # fp32 weight, bf16 input: rms_norm_symint's composite fallback
    gpu = _ops(norm, torch.randn(4, 16, dtype=torch.bfloat16), CUDA, loss=lambda o, s: o.float().mean())
    assert not _find(gpu, "aten._fused_rms_norm.default")


def test_layer_norm_statistics_are_fp32_on_cuda_for_bf16():
    model, x = nn.LayerNorm(16).to(torch.bfloat16), torch.randn(4, 16, dtype=torch.bfloat16)
    # out 4*16*2 = 128 B; mean/rstd: 4 rows * 2 B (fake, CPU dtype) -> 4 rows * 4 B on CUDA
    assert _find(_ops(model, x, CPU), "aten.native_layer_norm.default")[0][2] == [128, 8, 8]
    assert _find(_ops(model, x, CUDA), "aten.native_layer_norm.default")[0][2] == [128, 16, 16]


def test_layer_norm_fp32_is_the_same_on_both_targets():
    model, x = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16)), torch.randn(4, 8)
    assert _forward_backward(_ops(model, x, CPU)) == _forward_backward(_ops(model, x, CUDA))


class _LN2dGroupNorm(nn.Module):
    """A channels-last map into a GroupNorm (ConvNeXt's LayerNorm2d before a GroupNorm)."""

    def __init__(self, c=8):
        super().__init__()
        self.ln, self.gn = nn.LayerNorm(c), nn.GroupNorm(2, c)

    def forward(self, x):
        return self.gn(self.ln(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))


def test_group_norm_buffers_on_cuda():
    # N = 2, C = 8, HxW = 16 * 16, G = 2, fp32 (kAccType fp32, 4 B).  Forward, affine: a and b,
    # (N, C) each: 2 * 2 * 8 * 4 = 128.  Backward (dX wanted, weight, HxW > 1): ds, db (N, C),
    # c1 (N, G, D) = N * C, c2, c3 (N, G): (3 * 16 + 2 * 4) * 4 = 224
    gpu = _ops(nn.Sequential(nn.Conv2d(3, 8, 1), nn.GroupNorm(2, 8)), torch.randn(2, 3, 16, 16), CUDA)
    assert _find(gpu, "aten.native_group_norm.default")[0][3] == [128]
    assert _find(gpu, "aten.native_group_norm_backward.default")[0][3] == [224]


def test_group_norm_of_a_channels_last_map_on_cuda():
    # CUDA runs native_group_norm on X.contiguous() (group_norm.cpp: Contiguous off the CPU): the
    # channels-last map (2 * 8 * 16 * 16 * 4 = 16384 B) is copied in the forward (16384 + 128);
    # the backward copies it again and the loss's expanded gradient (dY.contiguous()): 2 * 16384 + 224
    gpu = _ops(_LN2dGroupNorm(), torch.randn(2, 8, 16, 16), CUDA)
    assert _find(gpu, "aten.native_group_norm.default")[0][3] == [16384 + 128]
    assert _find(gpu, "aten.native_group_norm_backward.default")[0][3] == [2 * 16384 + 224]


def _meta_ln_backward(M, N, rms=False):
    x = torch.empty(M, N, device="meta")
    w = torch.empty(N, device="meta")
    if rms:
        args = (torch.empty(M, N, device="meta"), x, [N], torch.empty(M, 1, device="meta"), w, [True, True])
        op = aten._fused_rms_norm_backward.default
    else:
        stats = torch.empty(M, 1, device="meta")
        args = (torch.empty(M, N, device="meta"), x, [N], stats, stats, w, w, [True, True, True])
        op = aten.native_layer_norm_backward.default
    return lookup(op, args, {}, op(*args), Target.CUDA)


def test_layer_norm_backward_partial_sums_above_64k_rows():
    # M = 65537 > 65536, N = 32: N / 32 = 1 < 132 / 2.  blocks.x = 1, blocks.y = min(32768 / 1,
    # ceil(65537 / 32) = 2049) = 2049: dgamma_blocks + dbeta_blocks = 2 * 2049 * 32 * 4 = 524544,
    # + the new dgamma from .sum(0) while the old one is alive: 32 * 4 = 128
    assert _meta_ln_backward(65537, 32).scratch == (524544 + 128,)
    # RMSNorm: dgamma only: 2049 * 32 * 4 + 128
    assert _meta_ln_backward(65537, 32, rms=True).scratch == (262272 + 128,)
    # M = 2 ** 20: blocks.y = min(32768, 32768) = 32768: 2 * 32768 * 32 * 4 + 128
    assert _meta_ln_backward(2**20, 32).scratch == (2 * 32768 * 128 + 128,)
    assert _meta_ln_backward(65536, 32) == NO_FIX  # not > 64 * 1024
    assert _meta_ln_backward(65537, 2112) == NO_FIX  # 2112 / 32 = 66: not < 66


def test_branches_on_the_batch_become_shape_guards():
    # symbolic batch: M = b rows > 65536 (LayerNorm backward) and n = 10 b <= 3072 (embedding
    # backward) are comparisons on the batch symbol: the capture's valid range records them
    spec = StepSpec(Mode.TRAIN, steps.optimizer_factory("sgd"), steps.default_loss, CUDA)
    raw = capture(nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16)), torch.randn(4, 8), spec, 4, symbolic=True)
    assert raw.guards == ("b <= 65536",) and raw.valid_to == 65536
    raw = capture(nn.Embedding(100, 16), torch.randint(0, 100, (4, 10)), spec, 4, symbolic=True)
    assert raw.guards == ("10*b <= 3072",)  # (the ShapeEnv does not turn this one into a range)


# -- batch norm: no entry, the CPU-only temporaries vanish ------------------------------------
def test_batch_norm_on_cuda_has_no_cpu_temporaries():
    model, x = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)), torch.randn(2, 3, 3, 3)
    cpu, gpu = _ops(model, x, CPU), _ops(model, x, CUDA)
    # CPU batch_norm_cpu: 2 * C * 4 = 32 B of per-channel temporaries (measured on the host,
    # cpu/norm.py); CUDA: none
    assert _find(cpu, "aten.native_batch_norm.default")[0][3] == [32]
    assert _find(gpu, "aten.native_batch_norm.default")[0][3] == []
    # the outputs are the same: out 2*4*3*3*4 = 288 B, save_mean/invstd C fp32 each
    assert _find(gpu, "aten.native_batch_norm.default")[0][2] == [288, 16, 16]


def test_batch_norm_statistics_are_fp32_on_cuda_for_bf16():
    model, x = nn.BatchNorm2d(4).to(torch.bfloat16), torch.randn(2, 4, 3, 3, dtype=torch.bfloat16)
    # out 2*4*3*3*2 = 144 B; save_mean / save_invstd: C = 4 in bf16 (fake) -> fp32 (batch_norm_cuda)
    assert _find(_ops(model, x, CPU), "aten.native_batch_norm.default")[0][2] == [144, 8, 8]
    assert _find(_ops(model, x, CUDA), "aten.native_batch_norm.default")[0][2] == [144, 16, 16]
    # eval: 0-element statistics on both
    assert _find(_ops(model, x, CUDA, Mode.INFERENCE), "aten.native_batch_norm.default")[0][2] == [144, 0, 0]


# -- embedding backward ----------------------------------------------------------------------
def test_embedding_backward_sorted_path_fused_atomic():
    # n = 4 * 1024 = 4096 indices (int64, i = 8) > 3072; W = 100, D = 16, fp32: out 6400 B
    # peak 1: sorted + orig + range 3 * 4096 * 8 = 98304, CUB temp 32768 + 32768 + 255 = 65791,
    #         - the output (not allocated yet) 6400 -> 157695
    # S = min(4096, 100) = 100, P = 4096 // 10 + 100 = 509; stride_warped = block = 32,
    # grid = 100 < 4 * 132 and P > 4 * 100: fused path: partial_to_segment_idx 509 * 8 = 4072
    # peak 2: 65536 + segment_offsets 32768 + 16 + 2 * 100 * 8 + 509 * 8 + 4072 = 108064
    gpu = _ops(nn.Embedding(100, 16), torch.randint(0, 100, (4, 1024)), CUDA)
    assert _find(gpu, "aten.embedding_dense_backward.default")[0][2:] == ([6400], [157695, 108064])
    cpu = _ops(nn.Embedding(100, 16), torch.randint(0, 100, (4, 1024)), CPU)
    assert _find(cpu, "aten.embedding_dense_backward.default")[0][2:] == ([6400], [])


def test_embedding_backward_two_pass_path():
    # W = 5000: S = min(4096, 5000) = 4096, grid = 4096 >= 528: two-pass path,
    # P = 409 + 4096 = 4505, grad_weight_per_segment 4505 * 16 * 4 = 288320
    # peak 1: 98304 + 65791 - 5000 * 16 * 4 (320000) = -155905
    # peak 2: 65536 + 32768 + 16 + 2 * 4096 * 8 + 4505 * 8 + 288320 = 488216
    gpu = _ops(nn.Embedding(5000, 16), torch.randint(0, 5000, (4, 1024)), CUDA)
    assert _find(gpu, "aten.embedding_dense_backward.default")[0][3] == [-155905, 488216]


def test_embedding_backward_fused_path_bf16_accumulates_in_fp32():
    grad = torch.empty(4096, 16, dtype=torch.bfloat16, device="meta")
    idx = torch.empty(4096, dtype=torch.long, device="meta")
    args = (grad, idx, 100, -1, False)
    fix = lookup(aten.embedding_dense_backward.default, args, {}, aten.embedding_dense_backward(*args), Target.CUDA)
    # out 100 * 16 * 2 = 3200: peak 1 = 98304 + 65791 - 3200; fused path + grad_weight_acc
    # (W * D * 4 = 6400): 65536 + 32768 + 16 + 1600 + 4072 + 4072 + 6400
    assert fix.scratch == (160895, 114464)


def test_embedding_backward_small_and_scaled():
    m, x = nn.Embedding(100, 16), torch.randint(0, 100, (4, 10))
    # n = 40 <= 3072: zeros({W, D}) + one kernel
    assert _find(_ops(m, x, CUDA), "aten.embedding_dense_backward.default")[0][3] == []
    # scale_grad_by_freq: the sorted path even for n = 40, plus count (40 * 8 = 320 B)
    # peak 1: 3 * 320 + (512 + 512 + 255) - 6400 = -4161; S = 40, P = 4 + 40 = 44,
    # grid = 40 < 528 but P = 44 <= 160: two-pass, 44 * 16 * 4 = 2816
    # peak 2: 640 + 320 + 320 + 16 + 2 * 40 * 8 + 44 * 8 + 2816 = 5104
    scaled = nn.Embedding(100, 16, scale_grad_by_freq=True)
    assert _find(_ops(scaled, x, CUDA), "aten.embedding_dense_backward.default")[0][3] == [-4161, 5104]


# -- losses ----------------------------------------------------------------------------------
LOSSES = [  # op, CPU scratch (measured, loss.py), CUDA scratch, full buffer kept under the scalar
    (aten.mse_loss.default, 8192 + 12, 8192, True),
    (aten.smooth_l1_loss.default, 8192 + 12, 8192, True),
    (aten.binary_cross_entropy.default, 16, 4, True),
    (aten.soft_margin_loss.default, 16, 4, True),
    (aten.huber_loss.default, 8192 + 12, 8192, False),
]


@pytest.mark.parametrize("op, cpu_scratch, cuda_scratch, keeps", LOSSES, ids=lambda v: str(v))
def test_loss_entries_per_target(op, cpu_scratch, cuda_scratch, keeps):
    # input (32, 64) fp32: N = 8192 B.  CUDA: mean_out is one reduction (no 8 + 4 B wrapped scalar
    # of the CPU's sum + div_); BCE / soft margin: the one-element reduced tensor (4 B).
    x, t = torch.rand(32, 64), torch.rand(32, 64)
    mean, none = {"reduction": 1}, {"reduction": 0}
    out = op(x, t, **mean)
    cpu, cuda = lookup(op, (x, t), mean, out, Target.CPU), lookup(op, (x, t), mean, out, Target.CUDA)
    assert cpu.scratch == (cpu_scratch,) and cuda.scratch == (cuda_scratch,)
    assert cpu.output_bytes == cuda.output_bytes == ({0: 8188} if keeps else {})
    assert lookup(op, (x, t), none, op(x, t, **none), Target.CUDA) == NO_FIX  # reduction none


def test_cross_entropy_is_the_same_on_both_targets():
    # log_softmax (host_softmax: the output only) + nll_loss (structured outputs only)
    model, x = nn.Linear(8, 10), torch.randn(4, 8)

    def loss(out, sample):
        return F.cross_entropy(out, torch.zeros(4, dtype=torch.long))

    assert _forward_backward(_ops(model, x, CPU, loss=loss)) == _forward_backward(_ops(model, x, CUDA, loss=loss))


# -- cuDNN RNN ------------------------------------------------------------------------------
class _Rnn(nn.Module):
    def __init__(self, cls, **kw):
        super().__init__()
        self.rnn = cls(32, 64, **kw)

    def forward(self, x):
        return self.rnn(x)[0]


def test_lstm_runs_cudnn_rnn_on_cuda():
    # LSTM(32, 64), T = 16, B = 4, fp32.  _cudnn_rnn: output 16*4*64*4 = 16384, hy = cy = 4*64*4
    # = 1024, reserve ESTIMATE 1*1*16*4*4*(4*64 + 64 + 64) = 98304
    gpu = _ops(_Rnn(nn.LSTM), torch.randn(16, 4, 32), CUDA)
    assert _find(gpu, "aten._cudnn_rnn.default")[0][2:] == ([16384, 1024, 1024, 98304], [])
    # backward: dx 8192, dhx 1024, dcx 1024, dw one flat buffer (4*64*32 + 4*64*64 + 2*256)*4 =
    # 100352; grad_hy/grad_cy undefined -> zeros 1024 + 1024; input phase 2048 - 100352
    assert _find(gpu, "aten._cudnn_rnn_backward.default")[0][2:] == ([8192, 1024, 1024, 100352], [-98304, 2048])
    cpu = _ops(_Rnn(nn.LSTM), torch.randn(16, 4, 32), CPU)
    assert _find(cpu, "aten.mkldnn_rnn_layer.default") and not _find(cpu, "aten._cudnn_rnn.default")


def test_gru_batch_first_copies_the_input():
    # GRU(32, 64, batch_first), x (4, 16, 32): output 16384, hy 1024, cy empty, reserve ESTIMATE
    # 16*4*4*(3*64 + 64 + 64) = 81920; x.transpose(0, 1).contiguous() 4*16*32*4 = 8192 in the op
    gpu = _ops(_Rnn(nn.GRU, batch_first=True), torch.randn(4, 16, 32), CUDA)
    assert _find(gpu, "aten._cudnn_rnn.default")[0][2:] == ([16384, 1024, 0, 81920], [8192])
    # backward: dx 8192, dhx 1024, dw (3*64*32 + 3*64*64 + 2*192)*4 = 75264; zeros(hy) 1024,
    # x copy 8192, dy copy 16384: input phase 1024 + 8192 + 16384 - 75264, weight phase 1024 + 8192
    assert _find(gpu, "aten._cudnn_rnn_backward.default")[0][2:] == ([8192, 1024, 75264], [-49664, 9216])


def test_lstm_without_bias_copies_the_weight_gradients():
    # 2 layers, bidirectional, no bias: the gradients are fresh tensors (stride 2 != 4), dw is
    # scratch with cuDNN's zero bias slots: params 2*(4*64*32 + 4*64*64)*4 + 2*(4*64*128 +
    # 4*64*64)*4 = 589824 B, + 2*2*2*4*64 = 2048 bias elements * 4 = 8192 -> 598016
    # zeros(hx) + zeros(cx) = 2 * 4*4*64*4 = 8192; reserve 2*2*16*4*4*384 = 393216
    gpu = _ops(_Rnn(nn.LSTM, bias=False, num_layers=2, bidirectional=True), torch.randn(16, 4, 32), CUDA)
    assert _find(gpu, "aten._cudnn_rnn.default")[0][2] == [32768, 4096, 4096, 393216]
    assert _find(gpu, "aten._cudnn_rnn_backward.default")[0][3] == [8192 - 589824, 8192 + 598016]


def test_rnn_inference_has_no_reserve():
    gpu = _ops(_Rnn(nn.LSTM), torch.randn(16, 4, 32), CUDA, Mode.INFERENCE)
    assert _find(gpu, "aten._cudnn_rnn.default")[0][2] == [16384, 1024, 1024, 0]


def test_cpu_target_has_none_of_the_cuda_entries():
    # (native_layer_norm has entries on both: CUDA's statistics, the CPU's measured strided calls)
    cuda_only = {
        aten.embedding_dense_backward.default, aten._cudnn_rnn.default,
        aten._cudnn_rnn_backward.default, aten._fused_rms_norm_backward.default,
    }
    assert not cuda_only & set(corrections.registered(Target.CPU))
    assert cuda_only <= set(corrections.registered(Target.CUDA))
    # native_batch_norm has an entry per target: the CPU temporaries, the CUDA statistics dtype
    bn = aten.native_batch_norm.default
    assert corrections.registered(Target.CPU)[bn] is not corrections.registered(Target.CUDA)[bn]
    assert not {F.dropout, torch.dropout, F.rms_norm} & set(corrections.substitutes(Target.CPU))
    assert corrections.substitutes(Target.CPU)[torch._VF.lstm] is packed.packed_rnn  # the packed overload alone
    assert all(isinstance(g.text, str) and g.text for g in kernels.NOT_MODELLED + rnn.NOT_MODELLED)


def test_cublas_clones_a_matrix_it_cannot_read():
    """``prepare_matrix_for_cublas`` (cuda/Blas.cpp): dense or leading-dimension layouts are used
    as they are, anything else (an expanded gradient, stride 0) is cloned contiguous."""
    from estimator.corrections.cuda.blas import clone_bytes

    base = torch.empty(4, 64)
    assert clone_bytes(torch.empty(4, 16)) == 0 and clone_bytes(torch.empty(16, 4).t()) == 0
    assert clone_bytes(base[:, :16]) == 0  # strides (64, 1): leading dimension 64 >= 16
    assert clone_bytes(torch.ones(()).expand(4, 4)) == 4 * 4 * 4  # stride (0, 0): a clone
    assert clone_bytes(base[:, ::2][:, :16]) == 16 * 4 * 4  # strides (64, 2): neither stride is 1


# -- pooling ------------------------------------------------------------------------------------
class _Pool(nn.Module):
    def __init__(self, pool, transposed: bool):
        super().__init__()
        self.scale, self.pool, self.transposed = nn.Parameter(torch.ones(())), pool, transposed

    def forward(self, x):
        x = x * self.scale  # (something to train)
        return self.pool(x.transpose(2, 3) if self.transposed else x)


def _pool_sum(out, sample):
    return out.sum()  # its gradient: an expanded (stride-0) tensor of the pool's output size


@pytest.mark.parametrize("pool, name", [(nn.MaxPool2d(3, 1, 1), "aten.max_pool2d_with_indices"),
                                        (nn.AvgPool2d(3, 1, 1), "aten.avg_pool2d")])
def test_pooling_copies_what_its_memory_format_does_not_hold(pool, name):
    """cuda/DilatedMaxPool2d.cu, cuda/AveragePool2d.cu: ``input_.contiguous(memory_format)`` in
    forward and backward, ``gradOutput_.contiguous(memory_format)`` in backward.  x (2, 4, 8, 8)
    fp32 = 2,048 B, the (same-sized) output's expanded gradient 2,048 B; the CPU target measures
    these calls instead (corrections/cpu/reduce.py)."""
    x = torch.randn(2, 4, 8, 8)
    plain = _ops(_Pool(pool, False), x, CUDA, loss=_pool_sum)
    assert _find(plain, f"{name}.default")[0][3] == []
    assert _find(plain, f"{name}_backward.default")[0][3] == [2048]  # the gradient only
    transposed = _ops(_Pool(pool, True), x, CUDA, loss=_pool_sum)
    assert _find(transposed, f"{name}.default")[0][3] == [2048]  # the input
    assert _find(transposed, f"{name}_backward.default")[0][3] == [2048 + 2048]


def test_adaptive_average_pool_copies_a_gradient_it_reads_contiguous():
    """cuda/AdaptiveAveragePooling.cu, ``Contiguous`` branch: ``gradOutput_.contiguous()``: the
    sum's expanded gradient of a (2, 4, 3, 3) output, 288 B."""
    ops = _ops(_Pool(nn.AdaptiveAvgPool2d(3), False), torch.randn(2, 4, 8, 8), CUDA, loss=_pool_sum)
    assert _find(ops, "aten._adaptive_avg_pool2d_backward.default")[0][3] == [288]


class _Laid(nn.Module):
    """The pool on ``x * scale`` laid out in ``memory_format`` (a copy made before the pool)."""

    def __init__(self, pool, memory_format):
        super().__init__()
        self.scale, self.pool, self.memory_format = nn.Parameter(torch.ones(())), pool, memory_format

    def forward(self, x):
        return self.pool((x * self.scale).contiguous(memory_format=self.memory_format))


def _pool_square(out, sample):
    return (out * out).sum()  # its gradient: 2 * out, laid out as the pool's output


def _pool_scratch(model, x, name, loss=_pool_sum):
    """(forward scratch, backward scratch) of the pool ``name`` in one CUDA-target step."""
    ops = _ops(model, x, CUDA, loss=loss)
    return _find(ops, f"{name}.default")[0][3], _find(ops, f"{name}_backward.default")[0][3]


CL3D = torch.channels_last_3d


def test_max_pool3d_copies_by_its_two_branches():
    """cuda/DilatedMaxPool3d.cu.  x (2, 4, 6, 6, 6) fp32 = 2*4*216*4 = 6,912 B; kernel 3, stride 1,
    padding 1: the output the same size (6,912 B), int64 indices 13,824 B.  Forward: contiguous
    branch ``input.contiguous()``, channels-last-3d branch ``_input.contiguous(ChannelsLast3d)``;
    backward: ``gradOutput`` and ``indices`` ``.contiguous(branch's format)``, the input never."""
    x, name = torch.randn(2, 4, 6, 6, 6), "aten.max_pool3d_with_indices"
    pool = nn.MaxPool3d(3, 1, 1)
    # contiguous: nothing forward; the sum's stride-0 gradient copied (6,912 B), the indices not
    assert _pool_scratch(_Pool(pool, False), x, name) == ([], [6912])
    # a transposed map: the input copied (6,912 B); the input is not read in backward
    assert _pool_scratch(_Pool(pool, True), x, name) == ([6912], [6912])
    # channels-last-3d: that branch reads it as it is; indices made channels-last-3d, not copied
    assert _pool_scratch(_Laid(pool, CL3D), x, name) == ([], [6912])
    # ... and a gradient laid out as the output (2 * out, channels-last-3d): no copy at all
    assert _pool_scratch(_Laid(pool, CL3D), x, name, _pool_square) == ([], [])


def test_max_pool3d_unbatched_channels_last_branch():
    """4-D input: ``channels_last = !input.unsqueeze(0).is_contiguous() &&
    input.unsqueeze(0).is_contiguous(ChannelsLast3d)``.  x (C=4, 6, 6, 6) fp32 = 3,456 B."""
    op, bwd = aten.max_pool3d_with_indices.default, aten.max_pool3d_with_indices_backward.default
    k = ([3, 3, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1], False)
    last = torch.randn(6, 6, 6, 4).permute(3, 0, 1, 2)  # channels innermost: that branch, no copy
    out, indices = op(last, *k)
    assert lookup(op, (last, *k), {}, (out, indices), Target.CUDA) == NO_FIX
    # backward on that branch: a gradient channels-last-3d when unsqueezed is read as it is; a
    # contiguous one is copied (3,456 B); the indices (channels-last-3d on the real forward) never
    grad = torch.randn(6, 6, 6, 4).permute(3, 0, 1, 2)
    assert lookup(bwd, (grad, last, *k, indices), {}, None, Target.CUDA) == NO_FIX
    assert lookup(bwd, (out.contiguous(), last, *k, indices), {}, None, Target.CUDA).scratch == (3456,)
    # H and W swapped: the contiguous branch copies the input (3,456 B)
    swapped = torch.randn(4, 6, 6, 6).transpose(2, 3)
    assert lookup(op, (swapped, *k), {}, op(swapped, *k), Target.CUDA).scratch == (3456,)


def test_avg_pool3d_has_no_channels_last_branch():
    """cuda/AveragePool3d.cu: ``input.contiguous()`` forward, ``gradOutput.contiguous()`` backward,
    whatever the input's layout; the output is contiguous (``TORCH_META_FUNC(avg_pool3d)``).
    x (2, 4, 6, 6, 6) fp32 = 6,912 B, output the same size."""
    x, name, pool = torch.randn(2, 4, 6, 6, 6), "aten.avg_pool3d", nn.AvgPool3d(3, 1, 1)
    assert _pool_scratch(_Pool(pool, False), x, name) == ([], [6912])  # the sum's gradient
    assert _pool_scratch(_Pool(pool, True), x, name) == ([6912], [6912])  # + the transposed input
    assert _pool_scratch(_Laid(pool, CL3D), x, name) == ([6912], [6912])  # channels-last-3d: copied
    assert _pool_scratch(_Laid(pool, CL3D), x, name, _pool_square) == ([6912], [])  # 2 * out: contiguous


def test_adaptive_max_pool2d_buffers_for_channels_last():
    """cuda/AdaptiveMaxPooling2d.cu.  x (2, 4, 8, 8) fp32 = 2,048 B; output (2, 4, 3, 3) fp32 =
    288 B, int64 indices 576 B, both in the input's suggested format (the meta function).
    Forward: ``input.contiguous()`` (4-D) + ``output_c`` / ``indices_c`` where the outputs are not
    contiguous; backward: ``gradOutput.contiguous()``, ``indices.contiguous()`` and ``gradInput_c``
    where the grad input is not contiguous."""
    x, name, pool = torch.randn(2, 4, 8, 8), "aten.adaptive_max_pool2d", nn.AdaptiveMaxPool2d(3)
    assert _pool_scratch(_Pool(pool, False), x, name) == ([], [288])  # the sum's gradient
    assert _pool_scratch(_Pool(pool, False), x, name, _pool_square) == ([], [])  # 2 * out: contiguous
    assert _pool_scratch(_Pool(pool, True), x, name) == ([2048], [288])  # the transposed input
    # channels-last: input 2,048 + output_c 288 + indices_c 576 = 2,912 forward; backward gradient
    # (channels-last or stride 0) 288 + indices 576 + gradInput_c 2,048 = 2,912
    cl = torch.channels_last
    assert _pool_scratch(_Laid(pool, cl), x, name) == ([2912], [2912])
    assert _pool_scratch(_Laid(pool, cl), x, name, _pool_square) == ([2912], [2912])
    # a (2, 4, 1, 1) output is contiguous and channels-last at once: no output_c / indices_c, and
    # 2 * out and the indices are contiguous: the input's copy (2,048 B), backward gradInput_c only
    assert _pool_scratch(_Laid(nn.AdaptiveMaxPool2d(1), cl), x, name, _pool_square) == ([2048], [2048])


@pytest.mark.parametrize("pool, name", [(nn.AdaptiveMaxPool3d(3), "aten.adaptive_max_pool3d"),
                                        (nn.AdaptiveAvgPool3d(3), "aten._adaptive_avg_pool3d")])
def test_adaptive_pool3d_copies_a_5d_input_not_contiguous(pool, name):
    """cuda/AdaptiveMaxPooling3d.cu, cuda/AdaptiveAveragePooling3d.cu: ``input.ndimension() == 4 ?
    input : input.contiguous()`` forward (no channels-last branch), ``gradOutput.contiguous()``
    backward.  x (2, 4, 6, 6, 6) fp32 = 6,912 B; output (2, 4, 3, 3, 3) = 864 B."""
    x = torch.randn(2, 4, 6, 6, 6)
    assert _pool_scratch(_Pool(pool, False), x, name) == ([], [864])  # the sum's gradient
    assert _pool_scratch(_Pool(pool, False), x, name, _pool_square) == ([], [])
    assert _pool_scratch(_Pool(pool, True), x, name) == ([6912], [864])
    assert _pool_scratch(_Laid(pool, CL3D), x, name, _pool_square) == ([6912], [])
    # unbatched (4, 6, 6, 6), H and W swapped: read through its strides, no copy
    assert _pool_scratch(_Pool(pool, True), torch.randn(4, 6, 6, 6), name, _pool_square) == ([], [])


def test_channels_last_3d_suggestion_is_torch_s():
    """``_suggested_channels_last_3d`` (a port of ``is_channels_last_strides_3d_s5``) answers as
    torch's ``suggest_memory_format`` for every permutation of 5-D tensors with size-1 dims and
    slices (concrete strides)."""
    import itertools

    from torch._prims_common import suggest_memory_format

    from estimator.corrections.cuda.pooling import _suggested_channels_last_3d

    for shape in [(2, 4, 6, 5, 3), (1, 4, 1, 1, 1), (2, 1, 3, 3, 3), (2, 3, 1, 4, 1), (1, 1, 1, 1, 1)]:
        for perm in itertools.permutations(range(5)):
            t = torch.empty(shape).permute(perm)
            for view in (t, t[..., ::2], t[:, :, :1]):
                want = suggest_memory_format(view) == CL3D
                assert _suggested_channels_last_3d(view) == want, (view.shape, view.stride())
