"""CUDA target: ``F.scaled_dot_product_attention`` (estimator/corrections/cuda/attention_backends.py,
attention_substitute.py, attention_workspaces.py).

Backend choice follows sdp_utils.cpp ``select_sdp_backend``; the bytes follow the CUDA kernels
(attention.cu, attention_backward.cu, flash_api.cpp, MHA.cpp), checked here by hand.

Model used by the byte tests (``Attn``), GPT-2 style without the output projection::

    qkv = x @ W^T                       (B, L, 3C)         W: (3C, C), no bias
    q, k, v = qkv.split(C, 2) -> (B, H, L, D) views      C = H*D
    y = sdpa(q, k, v, is_causal=True, dropout_p=p)
    out = y.transpose(1, 2).contiguous().view(B, L, C)   loss = out.mean()

with B = 4, L = 16, C = 64, H = 4, D = 16 unless said otherwise.  "Activations" are the storages
alive when backward starts (saved tensors, the output and the loss).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from estimator import corrections
from estimator.capture import steps
from estimator.capture.records import StepSpec
from estimator.capture.trace import capture
from estimator.corrections.cuda import attention_substitute, attention_workspaces
from estimator.corrections.cuda.attention_backends import Backend, select_backend, why_not
from estimator.vocab.categories import Category, Mode, Target
from estimator.vocab.errors import SymbolicCaptureFailed
from estimator.vocab.gpus import resolve_gpu
from estimator.vocab.target import TargetSpec

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
aten = torch.ops.aten


def cuda(gpu: str) -> TargetSpec:
    return TargetSpec(Target.CUDA, resolve_gpu(gpu))


def qkv(B=2, H=4, L=16, D=64, dtype=bf16, S=None, Hk=None, Dv=None, grad=False):
    """Meta tensors: the selection reads shapes, strides and dtypes only."""
    S = L if S is None else S
    Hk = H if Hk is None else Hk
    Dv = D if Dv is None else Dv
    make = lambda *shape: torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)
    return make(B, H, L, D), make(B, Hk, S, D), make(B, Hk, S, Dv)


def bool_mask(L=16, S=16, grad=False):
    m = torch.ones(L, S, dtype=torch.bool, device="meta")
    return m if not grad else torch.ones(L, S, device="meta", requires_grad=True)


# ---------------------------------------------------------------------------------------------
# Backend selection (sdp_utils.cpp @ 001f694a; cuDNN 9.20 assumed: cuDNN first on sm90/sm10x)

F_, E_, C_, M_ = Backend.FLASH, Backend.EFFICIENT, Backend.CUDNN, Backend.MATH
CASES = [
    # gpu,     dtype, D,   mask,  dropout, causal, grad, expected     why
    ("sm_90", bf16, 64, False, 0.1, True, True, F_),     # cuDNN: 0.1*16 not an integer (check_cudnn_dropout)
    ("sm_90", bf16, 64, False, 0.0, True, True, C_),     # cuDNN first on sm90 (check_prefer_cudnn_attention)
    ("sm_90", bf16, 64, False, 0.125, True, True, C_),   # 2/16: cuDNN's dropout resolution
    ("sm_80", bf16, 64, False, 0.1, True, True, F_),     # default order: flash first
    ("sm_80", bf16, 64, False, 0.0, True, True, F_),
    ("sm_90", fp32, 64, False, 0.1, True, True, E_),     # flash/cuDNN: fp16/bf16 only
    ("sm_80", fp32, 64, False, 0.0, False, False, E_),
    ("sm_90", fp16, 256, False, 0.0, False, False, F_),  # cuDNN head_dim limit 128 below cuDNN 9.22
    ("sm_90", bf16, 257, False, 0.0, False, True, M_),   # flash <= 256; efficient: 257 % 8
    ("sm_80", fp32, 257, False, 0.0, False, True, M_),   # efficient: 257 % 4 (sm80 fp32 alignment 4)
    ("sm_90", bf16, 72, False, 0.0, True, True, C_),     # 72 <= 128 and % 8 == 0
    ("sm_80", bf16, 72, False, 0.0, True, True, F_),
    ("sm_80", fp32, 72, False, 0.0, True, True, E_),
    ("sm_90", bf16, 100, False, 0.0, True, True, F_),    # cuDNN: 100 % 8; flash pads to 104
    ("sm_86", bf16, 256, False, 0.1, False, True, E_),   # flash backward on sm86: hd > 224 with dropout
    ("sm_86", bf16, 256, False, 0.0, False, True, F_),   # ... fine without dropout
    ("sm_120", bf16, 200, False, 0.0, False, True, E_),  # flash backward on sm120: hd in (192, 224]
    ("sm_120", bf16, 200, False, 0.0, False, False, F_),  # inference is fine
    ("sm_75", fp16, 64, False, 0.0, True, True, E_),     # flash/cuDNN need sm80
    ("sm_75", bf16, 64, False, 0.0, True, True, M_),     # efficient below sm80: fp16/fp32 only
    ("sm_75", fp32, 72, False, 0.0, True, True, E_),     # no tensor cores for fp32: alignment 1
    ("sm_100", bf16, 64, False, 0.0, True, True, C_),    # cuDNN first on sm10x too
    ("sm_100", bf16, 128, False, 0.1, True, True, F_),
    ("sm_80", bf16, 64, True, 0.0, False, False, E_),    # flash takes no mask
    ("sm_90", bf16, 64, True, 0.0, False, False, C_),    # cuDNN takes a 2-D mask
    ("sm_70", fp16, 64, False, 0.0, False, True, E_),
]


@pytest.mark.parametrize("gpu,dtype,D,mask,dropout,causal,grad,expected", CASES)
def test_select_backend_table(gpu, dtype, D, mask, dropout, causal, grad, expected):
    q, k, v = qkv(D=D, dtype=dtype, grad=grad)
    m = bool_mask() if mask else None
    assert select_backend(cuda(gpu), q, k, v, m, dropout, causal, False, grad) is expected


def test_gpt2_common_cases():
    """GPT-2 small (B=8, H=12, L=1024, D=64), causal, dropout 0.1, training."""
    for gpu, dtype, expected in [("H100", bf16, F_), ("H100", fp32, E_),
                                 ("NVIDIA A100-SXM4-80GB", bf16, F_), ("NVIDIA A100-SXM4-80GB", fp32, E_)]:
        q, k, v = qkv(B=8, H=12, L=1024, D=64, dtype=dtype, grad=True)
        assert select_backend(cuda(gpu), q, k, v, None, 0.1, True, False, True) is expected, (gpu, dtype)
    # Without dropout (e.g. nanoGPT's default dropout=0.0) bf16 goes to cuDNN on H100, flash on A100.
    q, k, v = qkv(B=8, H=12, L=1024, D=64, dtype=bf16, grad=True)
    assert select_backend(cuda("H100"), q, k, v, None, 0.0, True, False, True) is C_
    assert select_backend(cuda("NVIDIA A100-SXM4-80GB"), q, k, v, None, 0.0, True, False, True) is F_


def test_select_shapes_masks_gqa():
    s80, s90 = cuda("sm_80"), cuda("sm_90")
    # Causal with seqlen_q != seqlen_k: flash refuses (check_flash_causal_non_square_seqlens).
    q, k, v = qkv(L=16, S=32)
    assert select_backend(s80, q, k, v, None, 0.0, True) is E_
    # GQA: 8 query heads, 2 key/value heads, only with enable_gqa (and cuDNN takes it natively).
    q, k, v = qkv(H=8, Hk=2)
    assert select_backend(s80, q, k, v, None, 0.0, False, True) is F_
    assert select_backend(s80, q, k, v, None, 0.0, False, False) is M_
    assert select_backend(s90, q, k, v, None, 0.0, False, False) is C_
    # A mask that requires grad excludes cuDNN (check_attn_mask_shape).
    q, k, v = qkv()
    assert select_backend(s90, q, k, v, bool_mask(grad=True), 0.0, False) is E_
    # Last dimension not contiguous: no fused kernel.
    q = torch.empty(2, 4, 64, 16, dtype=bf16, device="meta").transpose(-1, -2)
    assert select_backend(s90, q, k, v, None, 0.0, False) is M_
    # Decode (one query) on sm100: cuDNN 9.19-9.25 disabled there (MHA.cpp check_cudnn_sdpa_decode).
    q, k, v = qkv(L=1, S=64)
    assert select_backend(cuda("sm_100"), q, k, v, None, 0.0, False) is F_
    assert select_backend(s90, q, k, v, None, 0.0, False) is C_
    # Older cuDNN (<= 9.15): the default order (flash first) on sm90.
    q, k, v = qkv()
    assert select_backend(s90, q, k, v, None, 0.0, False, cudnn_version=91000) is F_
    assert why_not(s90, Backend.FLASH, q, k, v, bool_mask()) == "flash attention does not take an attn_mask"


def test_select_honours_flags_priority_and_environment(monkeypatch):
    q, k, v = qkv()
    s90 = cuda("sm_90")
    with sdpa_kernel(SDPBackend.MATH):
        assert select_backend(s90, q, k, v) is M_
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        assert select_backend(s90, q, k, v) is F_  # the order is kept, cuDNN disabled
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True):
        assert select_backend(s90, q, k, v) is E_
    assert select_backend(s90, q, k, v) is C_
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert select_backend(s90, q, k, v) is F_
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED")
    torch.use_deterministic_algorithms(True)
    try:
        assert select_backend(s90, q, k, v) is F_  # check_cudnn_deterministic
    finally:
        torch.use_deterministic_algorithms(False)
    q, k, v = qkv(D=257)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(RuntimeError, match="No available kernel"):
        select_backend(s90, q, k, v)


def test_flash_split_kv_heuristic():
    """flash_api.cpp num_splits_heuristic on 2 * SMs: A100 (108 SMs), B=1, H=2, L=S=512, d=64:
    block_n 256 -> 2 key blocks, 8 query blocks; 16 blocks < 0.8 * 216; efficiency 16/216 for
    1 split, 32/216 for 2 -> 2 splits.  Dropout disables split-KV; 1 query with GQA swaps groups
    into rows."""
    assert attention_workspaces.flash_split_kv(1, 2, 2, 512, 512, 64, 0.0, 108) == (2, 512, 2)
    assert attention_workspaces.flash_split_kv(1, 2, 2, 512, 512, 64, 0.1, 108) == (1, 512, 2)
    assert attention_workspaces.flash_split_kv(64, 12, 12, 1024, 1024, 64, 0.0, 108) == (1, 1024, 12)
    assert attention_workspaces.flash_split_kv(1, 32, 8, 1, 4096, 128, 0.0, 132)[1:] == (4, 8)


# ---------------------------------------------------------------------------------------------
# Bytes of captured steps


class Attn(nn.Module):
    def __init__(self, C=64, H=4, p=0.0, dtype=fp32, causal=True, mask=None):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C, bias=False).to(dtype)
        self.H, self.p, self.causal, self.mask = H, p, causal, mask

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, dropout_p=self.p if self.training else 0.0,
                                           is_causal=self.causal)
        return y.transpose(1, 2).contiguous().view(B, T, C)


def run(model, x, target: TargetSpec, mode=Mode.TRAIN, batch=4, symbolic=False):
    spec = StepSpec(mode, steps.optimizer_factory("sgd") if mode is Mode.TRAIN else None, steps.default_loss, target)
    return capture(model, x, spec, batch=batch, symbolic=symbolic)


def activations(raw, b=4) -> int:
    return sum(s.nbytes(b) for s in raw.storages.values() if s.category is Category.ACTIVATION)


def op(raw, name):
    """(bytes allocated per output, scratch) of the one op called ``name``."""
    found = [e for e in raw.ops if e.name == name]
    assert len(found) == 1, [e.name for e in raw.ops]
    return [raw.storages[k].nbytes(raw.valid_from) for k in found[0].allocs], [s(raw.valid_from) for s in found[0].scratch]


def test_flash_bf16_training_bytes():
    """bf16, causal, dropout 0.1 on an A100: flash.  Saved for backward: q, k, v (views of qkv:
    4*16*192*2 = 24576), the output (B, L, H, D) memory, which the model's output shares because
    ``contiguous()`` of its transpose copies nothing (4*16*64*2 = 8192), the fp32 logsumexp
    B*H*L*4 = 1024, rng_state 16 B and the unused offset 8 B (both on CUDA), and the bf16 loss
    (2 B): 33818.  Forward scratch: the second rng_state (16 B).  Backward scratch (mha_bwd):
    softmax_d B*H*round128(L)*4 = 8192 + dq_accum B*round128(L)*H*round32(D)*4 = 262144."""
    raw = run(Attn(p=0.1, dtype=bf16), torch.randn(4, 16, 64).to(bf16), cuda("NVIDIA A100-SXM4-80GB"))
    assert activations(raw) == 24576 + 8192 + 1024 + 16 + 8 + 2
    assert op(raw, "aten._scaled_dot_product_flash_attention.default") == ([8192, 1024, 16, 8, 0], [16])
    grads, scratch = op(raw, "aten._scaled_dot_product_flash_attention_backward.default")
    assert grads == [8192] * 3 and scratch == [8192 + 262144]
    # The CPU target runs the CPU flash kernel instead: no CUDA op, no correction.
    cpu = run(Attn(p=0.1, dtype=bf16), torch.randn(4, 16, 64).to(bf16), TargetSpec())
    assert not any("_scaled_dot_product_flash_attention.default" == e.name for e in cpu.ops)


def test_flash_pads_head_dim_to_8():
    """D = 20 (C = 80, H = 4): attention.cpp pads q, k, v to 24 (three constant_pad_nd, B*H*L*24*2
    = 12288 B each), runs flash on them and slices the output back to 20."""
    raw = run(Attn(C=80, H=4, dtype=bf16), torch.randn(4, 16, 80).to(bf16), cuda("NVIDIA A100-SXM4-80GB"))
    pads = [e for e in raw.ops if e.name == "aten.constant_pad_nd.default" and e.phase.value == "forward"]
    assert [raw.storages[k].nbytes(4) for e in pads for k in e.allocs] == [12288] * 3
    allocs, _ = op(raw, "aten._scaled_dot_product_flash_attention.default")
    assert allocs[:2] == [12288, 4 * 4 * 16 * 4]


def test_efficient_fp32_training_bytes():
    """fp32 on an H100: mem-efficient.  Saved: qkv 4*16*192*4 = 49152, the output (B, L, H, D)
    memory 16384 (shared by the model's output), logsumexp B*H*round32(L)*4 = 2048, the seed and
    offset are CPU scalars (0 device bytes; the meta kernel's 8 + 8 are removed), loss 4: 67588.
    Backward (fp32: delta computed with torch ops): P = B*M*H*Kv*4 = 16384, the sum B*M*H*4 =
    1024 and delta 1024 -> 18432; then delta + workspace: kernel 64x64 k32, gradQ staging
    ceil(16/64)*ceil(16/64)*(4 + 64*64) = 4100 floats per (b, h): 4*4*4100*4 = 262400 -> 263424."""
    raw = run(Attn(p=0.1), torch.randn(4, 16, 64), cuda("H100"))
    assert activations(raw) == 49152 + 16384 + 2048 + 4
    assert op(raw, "aten._scaled_dot_product_efficient_attention.default") == ([16384, 2048, 0, 0], [])
    grads, scratch = op(raw, "aten._scaled_dot_product_efficient_attention_backward.default")
    assert grads == [16384] * 3 and scratch == [16384 + 1024 + 1024, 1024 + 262400]


def test_efficient_mask_is_padded_to_8():
    """A bool (12, 12) mask: converted to fp32 (12*12*4 = 576), its row stride 12 is not a
    multiple of 8, so ``pad_bias<8>`` pads it to (12, 16) (768 B) and slices it back; the
    logsumexp rounds L = 12 up to 32: 4*4*32*4 = 2048."""
    model = Attn(causal=False, mask=torch.ones(12, 12, dtype=torch.bool).tril())
    raw = run(model, torch.randn(4, 12, 64), cuda("H100"))
    assert op(raw, "aten.constant_pad_nd.default")[0] == [768]
    assert op(raw, "aten._scaled_dot_product_efficient_attention.default")[0] == [12288, 2048, 0, 0]


def test_cudnn_bf16_bytes():
    """bf16 without dropout on an H100: cuDNN.  Training saves qkv 24576, the output 8192,
    the stats (B, H, L, 1) fp32 = 1024, seed and offset 8 + 8 on CUDA, loss 2: 33810.  In
    inference ``compute_log_sumexp`` is false and cuDNN allocates no stats (the meta's 1024 B
    are removed)."""
    model = Attn(dtype=bf16)
    x = torch.randn(4, 16, 64).to(bf16)
    raw = run(model, x, cuda("H100"))
    assert activations(raw) == 24576 + 8192 + 1024 + 16 + 2
    raw = run(model.eval(), x, cuda("H100"), mode=Mode.INFERENCE)
    assert op(raw, "aten._scaled_dot_product_cudnn_attention.default")[0] == [8192, 0, 8, 8]


def test_math_fp32_saves_bool_dropout_mask():
    """The math path (forced with sdpa_kernel(MATH)), fp32, dropout 0.1.  Saved: the contiguous
    copies matmul makes of q*sqrt(scale), (k*sqrt(scale))^T and v (3 x B*H*L*D*4 = 3 x 16384),
    the softmax probabilities B*H*L*L*4 = 16384, the dropped probabilities 16384, the fused
    dropout's bool mask B*H*L*L = 4096, the model output 16384 and the loss 4: 102404.  The CPU
    target's dropout keeps an fp32 noise tensor instead of the bool mask: 12288 B more."""
    with sdpa_kernel(SDPBackend.MATH):
        raw = run(Attn(p=0.1), torch.randn(4, 16, 64), cuda("H100"))
        cpu = run(Attn(p=0.1), torch.randn(4, 16, 64), TargetSpec())
    assert activations(raw) == 3 * 16384 + 16384 + 16384 + 4096 + 16384 + 4
    assert op(raw, "aten.native_dropout.default")[0] == [16384, 4096]
    assert activations(cpu) - activations(raw) == 4 * 4096 - 4096


def test_flash_inference_split_kv_scratch():
    """Inference, bf16, B=1, H=2, L=512, D=64 on an A100: flash splits the keys in 2
    (test_flash_split_kv_heuristic): softmax_lse_accum + out_accum = 2*1*2*512*4*(1 + 64)
    = 532480 B of scratch; the logsumexp is freed with the op."""
    model = Attn(C=128, H=2, dtype=bf16).eval()
    raw = run(model, torch.randn(1, 512, 128).to(bf16), cuda("NVIDIA A100-SXM4-80GB"), mode=Mode.INFERENCE, batch=1)
    assert op(raw, "aten._scaled_dot_product_flash_attention.default") == ([131072, 4096, 16, 8, 0], [532480])
    # With a symbolic batch the split count would depend on b: the concrete fallback takes over.
    with pytest.raises(SymbolicCaptureFailed):
        run(model, torch.randn(2, 512, 128).to(bf16), cuda("NVIDIA A100-SXM4-80GB"), mode=Mode.INFERENCE, batch=2,
            symbolic=True)


@pytest.mark.parametrize("gpu,dtype,p", [("NVIDIA A100-SXM4-80GB", bf16, 0.1), ("H100", fp32, 0.1), ("H100", bf16, 0.0)])
def test_symbolic_capture_matches_concrete(gpu, dtype, p):
    x = torch.randn(4, 16, 64).to(dtype)
    sym = run(Attn(p=p, dtype=dtype), x, cuda(gpu), symbolic=True)
    con = run(Attn(p=p, dtype=dtype), x, cuda(gpu))
    assert [e.name for e in sym.ops] == [e.name for e in con.ops]
    for a, c in zip(sym.ops, con.ops):
        assert [sym.storages[k].nbytes(4) for k in a.allocs] == [con.storages[k].nbytes(4) for k in c.allocs]
        assert [s(4) for s in a.scratch] == [s(4) for s in c.scratch]


def test_cpu_target_unchanged():
    """The entries are CUDA-only: no CPU substitute or correction, and a CPU capture runs the
    CPU kernels."""
    assert F.scaled_dot_product_attention not in corrections.substitutes(Target.CPU)
    cpu_ops = corrections.registered(Target.CPU)
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention"):
        assert getattr(aten, name).default not in cpu_ops
        assert getattr(aten, name).default in corrections.registered(Target.CUDA)
    raw = run(Attn(dtype=bf16), torch.randn(4, 16, 64).to(bf16), TargetSpec())
    assert any("flash_attention_for_cpu" in e.name for e in raw.ops)
    assert not any(e.name.startswith("aten._scaled_dot_product_cudnn") for e in raw.ops)


def test_not_modelled_is_documented():
    assert any("workspace" in gap.text for gap in attention_substitute.NOT_MODELLED)
    assert all(gap.text and gap.ops for gap in attention_substitute.NOT_MODELLED)  # each concerns attention ops


def test_the_not_modelled_note_lists_what_applies():
    """The report's CUDA note names only the gaps of ops the step ran: an MLP's has no attention,
    RNN or convolution gap; an attention model's has its attention gaps."""
    from estimator.corrections.cuda import not_modelled

    mlp = not_modelled({"aten.addmm.default", "aten.relu.default", "aten.sum.default"})
    assert not any("attention" in g or "RNN" in g or "convolution" in g for g in mlp)
    assert any("reduction staging" in g for g in mlp) and len(mlp) < len(not_modelled())
    sdpa = not_modelled({"aten._scaled_dot_product_efficient_attention.default"})
    assert any("batch > 65535" in g for g in sdpa) and not any("cuDNN attention workspace" in g for g in sdpa)


def test_multihead_attention_and_encoder_layer_take_the_cuda_paths():
    """``F.multi_head_attention_forward`` re-dispatches through ``__torch_function__``; its entry
    keeps the substitutes active inside it.  fp32 on an H100: TransformerEncoderLayer
    (need_weights=False) -> mem-efficient in training and eval (the fused eval fast path of a real
    GPU runs the same kernel without a mask); its dropouts are the fused kernel.
    MultiheadAttention with need_weights=True keeps the bmm/softmax path."""
    for mode in (Mode.TRAIN, Mode.INFERENCE):
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
        if mode is Mode.INFERENCE:
            layer.eval()
        raw = run(layer, torch.randn(4, 16, 64), cuda("H100"), mode=mode)
        names = {e.name for e in raw.ops}
        assert "aten._scaled_dot_product_efficient_attention.default" in names
        assert "aten._safe_softmax.default" not in names and "aten._transformer_encoder_layer_fwd.default" not in names

    class Mha(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = nn.MultiheadAttention(64, 4, batch_first=True)

        def forward(self, x):
            return self.m(x, x, x)[0]

    names = {e.name for e in run(Mha(), torch.randn(4, 16, 64), cuda("H100")).ops}
    assert "aten.bmm.default" in names and not any("scaled_dot_product" in n for n in names)


class Proj(nn.Module):
    """Separate q/k/v projections: H query heads, Hk key/value heads of size D (GQA when Hk < H)."""

    def __init__(self, C, H, Hk, D, dtype, mask=None):
        super().__init__()
        self.q = nn.Linear(C, H * D, bias=False).to(dtype)
        self.kv = nn.Linear(C, 2 * Hk * D, bias=False).to(dtype)
        self.H, self.Hk, self.D, self.mask = H, Hk, D, mask

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.H, self.D).transpose(1, 2)
        k, v = (t.view(B, T, self.Hk, self.D).transpose(1, 2) for t in self.kv(x).split(self.Hk * self.D, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=self.Hk != self.H)
        return y.transpose(1, 2).reshape(B, T, self.H * self.D)


def test_flash_gqa_backward_expands_dk_dv():
    """GQA, bf16, A100 -> flash (no expansion in the forward).  mha_bwd allocates dk/dv for all 8
    query heads and sums them into the 2 key/value heads: B=4, S=16, H=8, D=16 ->
    2 * 4*16*8*16*2 = 32768, besides softmax_d 4*8*128*4 = 16384 and dq_accum 4*128*8*32*4 = 524288."""
    raw = run(Proj(64, 8, 2, 16, bf16), torch.randn(4, 16, 64).to(bf16), cuda("NVIDIA A100-SXM4-80GB"))
    grads, scratch = op(raw, "aten._scaled_dot_product_flash_attention_backward.default")
    assert grads == [4 * 8 * 16 * 16 * 2, 4 * 2 * 16 * 16 * 2, 4 * 2 * 16 * 16 * 2]
    assert scratch == [32768 + 16384 + 524288]


def test_efficient_fp16_large_head_dim_buffers():
    """fp16, D = 256, with a mask on an H100: flash takes no mask, cuDNN stops at 128 (cuDNN 9.20),
    so mem-efficient.  Forward: only the kMaxK = 65536 kernel fits, which accumulates in an fp32
    (B, M, H, Kv) buffer: 2*16*1*256*4 = 32768.  Backward kernel 128x64 k65536 (output not in
    registers): delta B*H*M*4 = 128 (computed by the kernel), workspace per (b, h): gK and gV
    staging 1 split * 64 * 256 = 16384 floats each, gQ ceil(16/128) * ceil(256/64) * (4 + 128*64)
    = 32784 floats -> 2*1*65552*4 = 524416 B."""
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    raw = run(Proj(64, 1, 1, 256, fp16, mask=mask), torch.randn(2, 16, 64).to(fp16), cuda("H100"), batch=2)
    assert op(raw, "aten._scaled_dot_product_efficient_attention.default")[1] == [32768]
    assert op(raw, "aten._scaled_dot_product_efficient_attention_backward.default")[1] == [128, 128 + 524416]
