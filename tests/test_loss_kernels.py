"""CPU loss kernels (estimator/corrections/cpu/loss.py): what they allocate inside the one aten op
the capture sees, against the profiler's allocator events.

Three levels:

- each corrected op called alone on real tensors: the peak and the net bytes the correction
  predicts (outputs at their real size, plus the largest scratch) equal the profiler's, to the
  byte (fp32 and bf16, every reduction, a serial size and one past ``GRAIN_SIZE``);
- the corrections' numbers worked out by hand (comments show the arithmetic);
- whole training steps of ``Linear + loss`` (``estimator.report`` against
  ``validators.cpu.measure_cpu``, b = 2, 8, 32), exact to the byte, and the GAN step of
  ``models_zoo.steps`` that found the ``binary_cross_entropy_with_logits`` gap.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import estimator
from estimator.account import account
from estimator.capture.records import StepSpec
from estimator.capture.trace import capture
from estimator.corrections import lookup
from estimator.corrections.cpu import loss as loss_fix
from estimator.vocab.categories import Mode
from estimator.vocab.symbolic import Poly
from models_zoo import steps
from validators.cpu import measure_cpu, measure_user_step, threads

aten = torch.ops.aten
NONE, MEAN, SUM = 0, 1, 2
REDUCTIONS = {"none": NONE, "mean": MEAN, "sum": SUM}


# -- one op against the profiler ------------------------------------------------------------------
def _allocations(func, args) -> tuple[object, list[int]]:
    """Run ``func(*args)`` once under the profiler: its output and the allocator's deltas."""
    func(*args)  # warm: first-call allocations (dispatcher caches) are not the kernel's
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = func(*args)
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    return out, [d for _, d in sorted(events)]


def _peak_and_net(deltas) -> tuple[int, int]:
    running = peak = 0
    for d in deltas:
        running += d
        peak = max(peak, running)
    return peak, running


def _predicted(func, args, out) -> tuple[int, int]:
    """The correction's view of the op: its outputs (fake sizes plus ``output_bytes``) alive at
    the end, and those plus the largest scratch at the op's peak."""
    fix = lookup(func, args, {}, out)
    outputs = [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]
    net = sum(t.numel() * t.element_size() for t in outputs) + sum(int(v) for v in fix.output_bytes.values())
    return net + max([0, *(int(s) for s in fix.scratch)]), net


def _case(name, dtype, shape, reduction):
    g = torch.Generator().manual_seed(0)
    c = shape[1]
    x = torch.randn(*shape, generator=g).to(dtype)
    y = torch.rand(*shape, generator=g).to(dtype)
    sign = torch.randn(*shape, generator=g).sign().to(dtype)
    w = torch.rand(c, generator=g).to(dtype)
    pw = (torch.rand(c, generator=g) + 1).to(dtype)
    grad = torch.ones(()) if reduction != NONE else torch.ones(shape)
    grad = grad.to(dtype)
    p = torch.sigmoid(x)
    labels = torch.randint(0, c, (shape[0], 1), generator=g)
    classes = torch.cat([labels, torch.full((shape[0], c - 1), -1)], 1)
    logits = aten.binary_cross_entropy_with_logits.default
    calls = {
        "bce_with_logits": (logits, (x, y, None, None, reduction)),
        "bce_with_logits weight": (logits, (x, y, w, None, reduction)),
        "bce_with_logits pos_weight": (logits, (x, y, None, pw, reduction)),
        "bce_with_logits both": (logits, (x, y, w, pw, reduction)),
        "bce_with_logits transposed": (logits, (x.t(), y.t(), None, None, reduction)),
        "bce_with_logits expanded target": (logits, (x, torch.ones((), dtype=dtype).expand(shape), None, None,
                                                     reduction)),
        "mse": (aten.mse_loss.default, (x, y, reduction)),
        "smooth_l1": (aten.smooth_l1_loss.default, (x, y, reduction, 1.0)),
        "huber": (aten.huber_loss.default, (x, y, reduction, 1.0)),
        "bce": (aten.binary_cross_entropy.default, (p, y, w, reduction)),
        "bce backward": (aten.binary_cross_entropy_backward.default, (grad, p, y, w, reduction)),
        "soft_margin": (aten.soft_margin_loss.default, (x, sign, reduction)),
        "soft_margin backward": (aten.soft_margin_loss_backward.default, (grad, x, sign, reduction)),
        # CPU multilabel margin: float and double only (AT_DISPATCH_FLOATING_TYPES)
        "multilabel_margin": (aten.multilabel_margin_loss_forward.default, (x.double() if dtype != torch.float32 else x,
                                                                           classes, reduction)),
    }
    return calls[name]


OPS = ["bce_with_logits", "bce_with_logits weight", "bce_with_logits pos_weight", "bce_with_logits both",
       "bce_with_logits transposed", "bce_with_logits expanded target", "mse", "smooth_l1", "huber", "bce",
       "bce backward", "soft_margin", "soft_margin backward", "multilabel_margin"]


@pytest.mark.parametrize("reduction", REDUCTIONS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", OPS)
def test_op_against_profiler(name, dtype, reduction):
    # (32, 4): serial kernels; (128, 300): 38,400 elements, past GRAIN_SIZE (two-pass reductions
    # on several threads, and the 60 x 60 block of a transposed copy).  Exact: the peak and the
    # bytes left inside the op are the profiler's.
    for shape in ((32, 4), (128, 300)):
        func, args = _case(name, dtype, shape, REDUCTIONS[reduction])
        out, deltas = _allocations(func, args)
        assert _predicted(func, args, out) == _peak_and_net(deltas), (shape, deltas)


@pytest.mark.parametrize("pos_weight", [False, True], ids=["plain", "pos_weight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS, ids=str)
def test_bce_with_logits_program_is_the_kernels(reduction, dtype, pos_weight):
    # The whole allocation sequence, not only its peak: bce_with_logits_steps is Loss.cpp's order.
    func, args = _case("bce_with_logits pos_weight" if pos_weight else "bce_with_logits", dtype, (32, 4),
                       REDUCTIONS[reduction])
    _, deltas = _allocations(func, args)
    program = [n * sign for n, sign in loss_fix.bce_with_logits_steps(*args)]
    assert [int(d) for d in program] == deltas


# -- the numbers by hand --------------------------------------------------------------------------
def _fix(func, *args):
    return lookup(func, args, {}, func(*args))


def test_bce_with_logits_scratch_exact():
    x, t = torch.randn(32, 4), torch.rand(32, 4)  # N = 32 * 4 * 4 = 512 B
    op = aten.binary_cross_entropy_with_logits.default
    # mean: log_sigmoid output 512 + loss (1 - target) 512 + result 4 + div_'s wrapped int64 8
    # + its fp32 copy 4 = 1040 at the peak, less the 4-byte output: 2N + 12 = 1036
    assert _fix(op, x, t, None, None, MEAN).scratch == (1036,)
    # sum: 512 + 512 + 4, less 4: 2N = 1024 (log_sigmoid's buffer, freed first, ties: 2N - 4)
    assert _fix(op, x, t, None, None, SUM).scratch == (1024,)
    # none: the output is the loss buffer (512): log_sigmoid output + buffer = 1024, less 512
    assert _fix(op, x, t, None, None, NONE).scratch == (512,)
    # pos_weight (4,): log_sigmoid output 512 + log_weight (pos_weight - 1).mul(target) 512 +
    # (pos_weight - 1) 16 + add_(1)'s wrapped int 8 + copy 4 = 1052, less the output 4 = 1048
    assert _fix(op, x, t, None, torch.full((4,), 2.0), MEAN).scratch == (1048,)
    # weight: loss.mul_(weight) in place, nothing more
    assert _fix(op, x, t, torch.rand(4), None, MEAN).scratch == (1036,)
    # bf16 mean, N = 256: log_sigmoid output 256 + loss 256 + result 2 + fp32 result 4 + the
    # loss's fp32 copy 4 * 128 = 512 -> 1030, less the 2-byte output: 4N + 4 = 1028
    xb, tb = x.bfloat16(), t.bfloat16()
    assert _fix(op, xb, tb, None, None, MEAN).scratch == (1028,)
    assert _fix(op, xb, tb, None, None, SUM).scratch == (512,)  # 256 + 256 + 2, less 2


def test_other_loss_scratch_exact():
    x, t = torch.randn(32, 4), torch.rand(32, 4)  # N = 512 B
    sign, grad = t.round() * 2 - 1, torch.ones(())
    # soft_margin_loss_backward: -target 512, the product 512, z 512 before grad_input exists:
    # 1536 less the 512-byte output = 2N (the later N + 8 + 4 is 500 B lower: dropped)
    assert _fix(aten.soft_margin_loss_backward.default, grad, x, sign, MEAN).scratch == (1024,)
    # binary_cross_entropy_backward, mean: div_(numel) wraps an int64 (8) copied to fp32 (4)
    p = torch.sigmoid(x)
    assert _fix(aten.binary_cross_entropy_backward.default, grad, p, t, None, MEAN).scratch == (12,)
    assert _fix(aten.binary_cross_entropy_backward.default, grad, p, t, None, SUM).scratch == ()
    # mse_loss keeps the 512-byte structured output under the scalar (508 more than its 4 B);
    # mean: the loss temporary 512 + div_'s 8 + 4 = 524 above it; sum: the temporary alone
    mean = _fix(aten.mse_loss.default, x, t, MEAN)
    assert (mean.output_bytes, mean.scratch) == ({0: 508}, (524,))
    assert _fix(aten.mse_loss.default, x, t, SUM).scratch == (512,)
    # bf16 mean (N = 256): temporary 256 + fp32 result 4 + fp32 copy 512 = 772 above the output
    assert _fix(aten.mse_loss.default, x.bfloat16(), t.bfloat16(), MEAN).scratch == (772,)
    # huber_loss, sum: loss 512 + the 4-byte result, less the result: 512
    assert _fix(aten.huber_loss.default, x, t, SUM, 1.0).scratch == (512,)
    # binary_cross_entropy, sum: the one-element reduced tensor (4), alive with the kept 512
    assert _fix(aten.binary_cross_entropy.default, p, t, None, SUM).scratch == (4,)
    # multilabel_margin_loss: target.min() and target.max(), an 8-byte int64 each in turn
    labels = torch.cat([torch.randint(0, 4, (32, 1)), torch.full((32, 3), -1)], 1)
    assert _fix(aten.multilabel_margin_loss_forward.default, x, labels, MEAN).scratch == (8,)


def test_bce_with_logits_scratch_is_a_formula_in_b():
    # Captured with b symbolic: logits (b, 256) fp32, N = 1024 b; mean: 2N + 12 = 2048 b + 12.
    torch.manual_seed(0)
    spec = StepSpec(Mode.TRAIN, None, lambda out, s: F.binary_cross_entropy_with_logits(out, s[1]))
    with threads(2):  # the two-pass buffer (2 x 4 B) is below div_'s 8 + 4 B: no guard on b
        raw = capture(_Head(), (torch.randn(8, 4), torch.rand(8, 256)), spec, 8, symbolic=True)
    ops = [op for op in account(raw).ops if op.op == "aten.binary_cross_entropy_with_logits.default"]
    assert [op.scratch for op in ops] == [(Poly((12, 2048)),)]
    assert raw.guards == ()


# -- whole steps against the profiler -------------------------------------------------------------
class _Head(nn.Module):
    """``Linear(4, 256)`` (1,280 parameters): at every b the loss's temporaries are the step's
    peak.  With ``weights``, ``weight`` and ``pos_weight`` buffers come out with the logits."""

    def __init__(self, dtype=torch.float32, weights=False):
        super().__init__()
        self.lin = nn.Linear(4, 256, dtype=dtype)
        self.weights = weights
        if weights:
            self.register_buffer("w", torch.rand(256, dtype=dtype))
            self.register_buffer("pw", torch.rand(256, dtype=dtype) + 1)

    def forward(self, x, target):
        out = self.lin(x)
        return (out, self.w, self.pw) if self.weights else out


def _sample(kind, dtype):
    def make(b):
        g = torch.Generator().manual_seed(b)
        x = torch.randn(b, 4, generator=g).to(dtype)
        if kind == "sign":
            return x, torch.randn(b, 256, generator=g).sign().to(dtype)
        if kind == "labels":
            return x, torch.cat([torch.randint(0, 256, (b, 1), generator=g), torch.full((b, 255), -1)], 1)
        return x, torch.rand(b, 256, generator=g).to(dtype)

    return make


def _reduced(loss):
    return loss if loss.dim() == 0 else loss.sum()


STEPS = {  # name: (loss_fn, sample kind, dtype, weights)
    "bce_with_logits mean": (lambda o, s: F.binary_cross_entropy_with_logits(o, s[1]), "probs", torch.float32, False),
    "bce_with_logits sum": (lambda o, s: F.binary_cross_entropy_with_logits(o, s[1], reduction="sum"), "probs",
                            torch.float32, False),
    "bce_with_logits none": (lambda o, s: _reduced(F.binary_cross_entropy_with_logits(o, s[1], reduction="none")),
                             "probs", torch.float32, False),
    "bce_with_logits weight pos_weight": (
        lambda o, s: F.binary_cross_entropy_with_logits(o[0], s[1], weight=o[1], pos_weight=o[2]), "probs",
        torch.float32, True),
    "bce_with_logits bf16": (lambda o, s: F.binary_cross_entropy_with_logits(o, s[1]), "probs", torch.bfloat16, False),
    "soft_margin mean": (lambda o, s: F.soft_margin_loss(o, s[1]), "sign", torch.float32, False),
    "soft_margin sum": (lambda o, s: F.soft_margin_loss(o, s[1], reduction="sum"), "sign", torch.float32, False),
    "mse bf16 mean": (lambda o, s: F.mse_loss(o, s[1]), "probs", torch.bfloat16, False),
    "multilabel_margin mean": (lambda o, s: F.multilabel_margin_loss(o, s[1]), "labels", torch.float32, False),
}


@pytest.mark.parametrize("b", [2, 8, 32])
@pytest.mark.parametrize("name", STEPS)
def test_step_against_measurement(name, b):
    # Exact to the byte.  Before these entries (fxmem 9ece9a1): bce_with_logits weight +
    # pos_weight +5,120 / +24,576 / +98,304 B (the out-of-place backward chain), bf16 -514 B at
    # b = 2 and -16,642 B at b = 32, mean -8 B at b = 8 and 32; soft_margin -11,264 / -60,416 B
    # at b = 8 / 32 (its backward's three temporaries); multilabel_margin -8 B; mse bf16 -258 B
    # at b = 32 (the fp32 copy of mean_out).
    loss_fn, kind, dtype, weights = STEPS[name]
    sample = _sample(kind, dtype)(b)
    torch.manual_seed(0)
    rep = estimator.report(_Head(dtype, weights), sample, optimizer="sgd", loss_fn=loss_fn, device="cpu")
    torch.manual_seed(0)
    measured = measure_cpu(_Head(dtype, weights), sample, "train", "sgd", loss_fn)
    assert rep.peak_bytes == measured.peak_bytes


def test_gan_step_against_measurement():
    # models_zoo/steps.py "GAN: two optimizers" at b = 32: the discriminator's (32, 1) logits;
    # before the bce_with_logits entry 174,396 B predicted against 174,660 B measured (-264 B:
    # 2 x 128 + 8, the log_sigmoid output and the loss buffer).
    case = steps.CASES["GAN: two optimizers"]
    rep = estimator.report(case.make_model(), case.make_sample(32), step=case.step, optimizer=case.optimizer,
                           mode=case.mode, device="cpu")
    measured = measure_user_step(case.make_model(), case.make_sample(32), case.step, case.optimizer, case.mode)
    assert rep.peak_bytes == measured.peak_bytes == 174_660
