"""Mixed precision: ``report(amp=, grad_scaler=)`` on the CPU target (exact against the
measurement of the same step) and the CUDA target (CUDA's autocast lists emulated while
capturing, ``estimator/corrections/cuda/autocast.py``).

The step (estimator/capture/steps.py)::

    with torch.autocast(device_type, dtype): out = model(x); loss = loss_fn(out, x)
    scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); opt.zero_grad(set_to_none=True)

Sizes: fp32 4 B, fp16/bf16 2 B.  Autocast casts an op's arguments with ``_to_copy`` before the
op runs (the last argument first: ``linear``'s bias, weight, input).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import estimator
from estimator import Category
from estimator.account import account
from estimator.capture import steps
from estimator.capture.records import StepSpec
from estimator.capture.trace import capture
from estimator.corrections.cuda import autocast
from estimator.vocab.categories import Mode, Target
from estimator.vocab.errors import CaptureError, InputError
from estimator.vocab.gpus import resolve_gpu
from estimator.vocab.target import TargetSpec
from validators.cpu import measure_cpu

CPU = TargetSpec()
CUDA = TargetSpec(Target.CUDA, resolve_gpu("H100"))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


class Block(nn.Module):
    """A tiny transformer block: embedding, LayerNorm, one attention product with softmax, the
    vocabulary projection and cross-entropy (the loss is the model's output)."""

    def __init__(self, d: int = 8, vocab: int = 20):
        super().__init__()
        self.emb, self.ln = nn.Embedding(vocab, d), nn.LayerNorm(d)
        self.qk, self.o = nn.Linear(d, 2 * d), nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.ln(self.emb(ids))
        q, k = self.qk(h).chunk(2, -1)
        a = torch.softmax(q @ k.transpose(1, 2), -1)
        return F.cross_entropy(self.o(a @ h).flatten(0, 1), ids.flatten())


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.l = nn.Conv2d(3, 4, 3), nn.Linear(4 * 6 * 6, 10)

    def forward(self, x):
        return self.l(torch.relu(self.c(x)).flatten(1))


def _raw(model, x, target, amp="fp16", mode=Mode.INFERENCE, optimizer="sgd", loss_fn=steps.default_loss):
    factory = steps.optimizer_factory(optimizer) if mode is Mode.TRAIN else None
    spec = StepSpec(mode, factory, loss_fn, target, steps.Precision.of(amp, None, mode))
    return capture(model, x, spec, x.shape[0], symbolic=False)


def _allocs(raw, name: str) -> list[int]:
    """Bytes of each storage the ops called ``name`` allocated, in order."""
    return [int(raw.storages[k].nbytes(0)) for op in raw.ops if op.name == name for k in op.allocs]


def _tensor_peak(raw) -> int:
    """The peak of the captured tensors alone (no allocator model)."""
    return max(int(p(0)) for op in account(raw).ops for p in op.peaks())


# --------------------------------------------------------------------------------------------
# CPU target: the same step measured on real tensors


CASES = {
    "linear": (lambda: nn.Linear(16, 4), lambda b: torch.randn(b, 16), None),
    "mlp": (mlp, lambda b: torch.randn(b, 16), None),
    "block": (Block, lambda b: torch.randint(0, 20, (b, 4)), lambda out, x: out),
}


@pytest.mark.parametrize("amp", ["fp16", "bf16"])
@pytest.mark.parametrize("name,b", [("linear", 3), ("mlp", 8), ("block", 2), ("block", 5)])
def test_cpu_target_is_exact_against_the_measurement(name, b, amp):
    # fp16 trains with a GradScaler (the default), bf16 without; both with AdamW.
    make, x, loss_fn = CASES[name]
    torch.manual_seed(0)
    rep = estimator.report(make(), x(b), amp=amp, loss_fn=loss_fn, device="cpu")
    torch.manual_seed(0)
    measured = measure_cpu(make(), x(b), amp=amp, loss_fn=loss_fn)
    assert rep.peak_bytes == measured.peak_bytes
    # the GradScaler's 0-dim fp32 scale and int32 growth tracker: 4 + 4 B of optimizer state
    no_scaler = estimator.report(make(), x(b), amp=amp, loss_fn=loss_fn, grad_scaler=False, device="cpu")
    assert rep.breakdown[Category.OPTIMIZER_STATE] - no_scaler.breakdown[Category.OPTIMIZER_STATE] == (
        8 if amp == "fp16" else 0
    )


@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_cpu_inference_with_autocast_is_exact(amp):
    torch.manual_seed(0)
    rep = estimator.report(Block(), torch.randint(0, 20, (3, 4)), mode="inference", amp=amp, device="cpu")
    torch.manual_seed(0)
    assert rep.peak_bytes == measure_cpu(Block(), torch.randint(0, 20, (3, 4)), mode="inference", amp=amp).peak_bytes


@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_cpu_conv_in_low_precision(amp):
    # fp16 runs THNN _slow_conv2d_forward with an im2col buffer, bf16 oneDNN with other reorders:
    # both measured on the host (estimator.corrections.cpu.host), so exact
    x = torch.randn(3, 3, 8, 8)
    torch.manual_seed(0)
    rep = estimator.report(Conv(), x, optimizer="sgd", amp=amp, device="cpu")
    torch.manual_seed(0)
    assert rep.peak_bytes == measure_cpu(Conv(), x, optimizer="sgd", amp=amp).peak_bytes


# --------------------------------------------------------------------------------------------
# The weight-cast cache (cached_cast in aten/src/ATen/autocast_mode.cpp)


class Twice(nn.Module):
    """One Linear used twice, then an op four times as wide as its output."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 16)

    def forward(self, x):
        h = self.l(self.l(x))
        return torch.cat([h, h, h, h], 1)


@pytest.mark.parametrize("target", [CPU, CUDA], ids=["cpu", "cuda"])
def test_a_parameter_is_cast_once_and_stays_cast_to_the_end_of_the_region(target):
    # Inference, fp16.  Parameters W 16*16*4 = 1024 + bias 16*4 = 64: 1088 B; x (b,16) fp32: 64b.
    # First linear: casts bias (32 B), W (512 B) and x (32b); addmm -> h1 (b,16) fp16 32b;
    # x16 dies after the addmm (no_grad: nothing saved).  Second linear: W16 and bias16 come
    # from the cache (leaves that require grad, fp32, not views); h1 is already fp16: no cast;
    # addmm -> h2 32b.  cat -> (b,64) fp16: 128b.  W16 and bias16 die when autocast exits.
    # At cat: 1088 + 64b + 544 + h2 32b + out 128b = 224b + 1632.  Without the cache the
    # casts would die after each addmm: 224b + 1088 at cat.
    b = 4
    raw = _raw(Twice(), torch.randn(b, 16), target)
    assert _allocs(raw, "aten._to_copy.default") == [32, 512, 32 * b]  # one cast of W, of bias
    w16 = next(k for op in raw.ops for k in op.allocs if int(raw.storages[k].nbytes(0)) == 512)
    assert w16 in raw.ops[-1].frees  # freed with the region's end, after the last op
    assert _tensor_peak(raw) == 224 * b + 1632
    if target is CPU:
        assert measure_cpu(Twice(), torch.randn(b, 16), mode="inference", amp="fp16").peak_bytes == 224 * b + 1632


# --------------------------------------------------------------------------------------------
# CUDA target: CUDA's op lists, not the CPU's


class LnSoftmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.l, self.ln = nn.Linear(16, 32), nn.LayerNorm(32)

    def forward(self, x):
        return torch.softmax(self.ln(self.l(x)), -1)


def test_layer_norm_and_softmax_run_in_fp32_under_cuda_autocast():
    x = torch.randn(4, 16)
    cpu, cuda = _raw(LnSoftmax(), x, CPU), _raw(LnSoftmax(), x, CUDA)
    # Both lists run linear in fp16: casts of bias 32*2, W 32*16*2, x 4*16*2 B; out (4,32) fp16.
    for raw in (cpu, cuda):
        assert _allocs(raw, "aten._to_copy.default")[:3] == [64, 1024, 128]
        assert _allocs(raw, "aten.addmm.default") == [256]
    # CPU: layer_norm and softmax are on no CPU list: they run in fp16 (output 4*32*2 = 256,
    # mean and rstd 4*2 = 8 each).
    assert _allocs(cpu, "aten.native_layer_norm.default") == [256, 8, 8]
    assert _allocs(cpu, "aten._softmax.default") == [256]
    # CUDA: layer_norm is fp32 (AT_FORALL_FP32): the fp16 input is copied to fp32 (512 B) and
    # the outputs are fp32 (512, mean/rstd 4*4 = 16); softmax's input is then fp32: 512.
    assert _allocs(cuda, "aten._to_copy.default")[3:] == [512]
    assert _allocs(cuda, "aten.native_layer_norm.default") == [512, 16, 16]
    assert _allocs(cuda, "aten._softmax.default") == [512]


class Softmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 32)

    def forward(self, x):
        return torch.softmax(self.l(x), -1)


def test_softmax_of_a_half_input_is_the_half_to_float_kernel_on_cuda():
    # fp32_set_opt_dtype passes dtype=float32; CUDA's softmax then runs _softmax(x, dim,
    # half_to_float=True): fp32 output 4*32*4 = 512 B without an fp32 copy of the input, and the
    # backward's grad_input is fp16 (256 B).  The CPU target runs it all in fp16.
    x = torch.randn(4, 16)
    cuda = _raw(Softmax(), x, CUDA, mode=Mode.TRAIN)
    forward = [op.name for op in cuda.ops if op.phase.value == "forward"]
    assert forward[forward.index("aten.addmm.default") + 1] == "aten._softmax.default"  # no _to_copy between
    assert _allocs(cuda, "aten._softmax.default") == [512]
    assert _allocs(cuda, "aten._softmax_backward_data.default") == [256]
    cpu = _raw(Softmax(), x, CPU, mode=Mode.TRAIN)
    assert _allocs(cpu, "aten._softmax.default") == [256]


class Cat(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 16)

    def forward(self, x):
        return torch.cat([self.l(x), x], 1)


def test_cat_promotes_on_the_cpu_list_only():
    # CPU autocast's cat is "promote": the fp16 linear output (4*16*2 = 128 B) is copied to fp32
    # (256 B) first.  CUDA has no autocast kernel for cat: cat's own type promotion writes the
    # fp32 result (4*32*4 = 512 B) without the copy.
    x = torch.randn(4, 16)
    assert _allocs(_raw(Cat(), x, CPU), "aten._to_copy.default")[3:] == [256]
    assert _allocs(_raw(Cat(), x, CUDA), "aten._to_copy.default")[3:] == []
    assert _allocs(_raw(Cat(), x, CUDA), "aten.cat.default") == [512]


class Bce(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 1)

    def forward(self, x):
        return F.binary_cross_entropy(torch.sigmoid(self.l(x)), torch.zeros(x.shape[0], 1))


def test_binary_cross_entropy_is_banned_under_cuda_autocast_only():
    x = torch.randn(4, 16)
    assert estimator.report(Bce(), x, amp="fp16", optimizer="sgd", loss_fn=lambda out, x: out,
                            device="cpu").peak_bytes > 0
    with pytest.raises(CaptureError, match="binary_cross_entropy.*unsafe to autocast"):
        estimator.report(Bce(), x, amp="fp16", optimizer="sgd", loss_fn=lambda out, x: out, device="cuda")


def test_grad_scaler_state_on_the_cuda_target():
    # AdamW on Linear(16, 4): exp_avg + exp_avg_sq 2 * (64 + 4) * 4 = 544 B; CUDA keeps the step
    # counters on the host; the scaler's scale and growth tracker are on the device: + 8 B.
    x = torch.randn(4, 16)
    rep = estimator.report(nn.Linear(16, 4), x, amp="fp16", device="cuda")
    assert rep.breakdown[Category.OPTIMIZER_STATE] == 544 + 8
    assert {"grad_scaler__scale", "grad_scaler__growth_tracker"} <= {n.name for n in rep.graph.nodes}
    bf16 = estimator.report(nn.Linear(16, 4), x, amp="bf16", device="cuda")
    assert bf16.breakdown[Category.OPTIMIZER_STATE] == 544


def test_the_emulation_leaves_nothing_behind():
    ops = ["aten::mm", "aten::layer_norm", "aten::cat", "aten::softmax.int", "aten::binary_cross_entropy"]
    before = {op: torch._C._dispatch_dump_table(op) for op in ops}
    clear = torch.clear_autocast_cache
    _raw(LnSoftmax(), torch.randn(4, 16), CUDA, mode=Mode.TRAIN)
    with pytest.raises(CaptureError):  # an error inside the region restores too
        _raw(Bce(), torch.randn(4, 16), CUDA, mode=Mode.TRAIN, loss_fn=lambda out, x: out)
    assert {op: torch._C._dispatch_dump_table(op) for op in ops} == before
    assert torch.clear_autocast_cache is clear
    with torch.autocast("cpu", dtype=torch.float16):  # native CPU autocast again
        assert F.layer_norm(torch.randn(2, 4).half(), (4,)).dtype is torch.float16


def test_the_op_lists_match_this_torch():
    def have(key):
        names = (n for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::"))
        return {n[6:] for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(n, key)}

    existing = lambda names: {n for n in names if autocast.overload(n) is not None}
    cpu_lists = (*autocast.CPU_LOWER_PRECISION_FP, *autocast.CPU_FP32, *autocast.CPU_PROMOTE)
    assert existing(cpu_lists) == have("AutocastCPU")
    assert existing(autocast.CUDA_POLICY) == have("AutocastCUDA")


# --------------------------------------------------------------------------------------------
# Arguments


def test_bad_precision_arguments():
    x = torch.randn(2, 16)
    with pytest.raises(InputError, match="amp must be one of"):
        estimator.report(nn.Linear(16, 4), x, amp="fp8", device="cpu")
    with pytest.raises(InputError, match="grad_scaler=True needs mixed precision"):
        estimator.report(nn.Linear(16, 4), x, grad_scaler=True, device="cpu")
    with pytest.raises(InputError, match="grad_scaler=True .* needs mode='train'"):
        estimator.report(nn.Linear(16, 4), x, mode="inference", amp="fp16", grad_scaler=True, device="cpu")
    with pytest.raises(InputError, match="grad_scaler must be"):
        estimator.report(nn.Linear(16, 4), x, amp="fp16", grad_scaler="yes", device="cpu")


def test_amp_inference_has_no_scaler_and_defaults():
    assert steps.Precision.of("fp16", None, Mode.TRAIN) == steps.Precision("fp16", True)
    assert steps.Precision.of("bf16", None, Mode.TRAIN) == steps.Precision("bf16", False)
    assert steps.Precision.of("fp16", None, Mode.INFERENCE) == steps.Precision("fp16", False)
    rep = estimator.report(nn.Linear(16, 4), torch.randn(2, 16), mode="inference", amp="fp16", device="cpu")
    assert rep.breakdown[Category.OPTIMIZER_STATE] == 0
