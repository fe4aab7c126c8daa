"""Exact bytes on tiny models, derived by hand from the op sequence of the step.

Notation: ``b`` is the batch size; fp32 is 4 bytes.  The step is (estimator/capture/steps.py)

    out = model(x); loss = loss_fn(out, x); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

in the steady state (the optimizer state already exists), with ``out`` and ``loss`` alive to the
end.  The default loss is ``out.mean()``: forward allocates the 4-byte loss; backward allocates
``ones_like(loss)`` (4 B) and ``MeanBackward``'s ``grad / numel`` (the size of ``out``).

Reference case used below, ``nn.Linear(16, 4)`` (W: 4x16, bias 4), SGD without momentum:

    parameters      16*4*4 + 4*4                         = 272
    input x         b*16*4                               = 64b
    forward         addmm -> out (b,4)                   = 16b   (activation)
                    mean  -> loss                        = 4     (activation)
    backward        ones_like(loss)                      = 4     (temporary)
                    div: grad_out = ones.expand / (4b)   = 16b   (temporary)
                    mm: grad_W = grad_out^T @ x          = 256   (gradient)
                    sum: grad_bias                       = 16    (gradient)
    optimizer       p.add_(grad, alpha=-lr): in place    = 0

The peak is at the bias-gradient ``sum``: 272 + 64b + 16b + 4 + 4 + 16b + 256 + 16 = 96b + 552.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import estimator
from estimator import Category, Phase, Poly
from tests.models import TwoInputs
from validators.cpu import measure_cpu

C = Category


def linear_x(b: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(b, 16).to(dtype)


def mlp() -> nn.Module:
    # Linear(16, 32): 16*32*4 + 32*4 = 2176 B; Linear(32, 8): 32*8*4 + 8*4 = 1056 B; total 3232 B.
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def lin(a: int, c: int = 0) -> Poly:
    """``a + c*b`` as an estimator.Poly."""
    return Poly.const(a) + Poly((0, c)) if c else Poly.const(a)


# --------------------------------------------------------------------------------------------
# Inference


@pytest.mark.parametrize("b", [2, 8, 33])
def test_mlp_inference(b):
    # no_grad forward of Sequential(Linear(16,32), ReLU, Linear(32,8)):
    #   params 3232, input 64b
    #   addmm -> h (b,32)         128b
    #   relu  -> r (b,32)         128b   h is still referenced by Sequential while relu runs
    #   h dropped; addmm -> out   32b    (r + out = 160b < 256b)
    # peak at relu: 3232 + 64b + 128b + 128b = 320b + 3232; nothing saved, nothing else alive.
    rep = estimator.report(mlp(), linear_x(b), mode="inference", device="cpu")
    assert rep.peak_bytes == 320 * b + 3232
    assert rep.peak == 320 * estimator.B + 3232
    assert rep.peak_piece.op == "aten.relu.default"
    assert rep.breakdown == {
        C.PARAMETER: 3232, C.BUFFER: 0, C.INPUT: 64 * b, C.GRADIENT: 0,
        C.OPTIMIZER_STATE: 0, C.COMMUNICATION: 0, C.ACTIVATION: 0, C.KV_CACHE: 0, C.TEMPORARY: 256 * b,
    }
    assert measure_cpu(mlp(), linear_x(b), mode="inference").peak_bytes == 320 * b + 3232


# --------------------------------------------------------------------------------------------
# Training, optimizers


@pytest.mark.parametrize("b", [2, 8, 40])
def test_linear_sgd(b):
    # See the module docstring: 96b + 552, the only piece for b >= 2.
    rep = estimator.report(nn.Linear(16, 4), linear_x(b), optimizer="sgd", device="cpu")
    assert rep.peak_bytes == 96 * b + 552
    assert [p.bytes for p in rep.pieces] == [lin(552, 96)]
    assert rep.peak_piece.phase is Phase.BACKWARD
    assert rep.breakdown == {
        C.PARAMETER: 272, C.BUFFER: 0, C.INPUT: 64 * b,
        C.GRADIENT: 256 + 16,                # grad_W + grad_bias
        C.OPTIMIZER_STATE: 0,                # plain SGD keeps no state
        C.COMMUNICATION: 0,                  # one device
        C.ACTIVATION: 16 * b + 4,            # out + loss
        C.KV_CACHE: 0,                       # no generate()
        C.TEMPORARY: 4 + 16 * b,             # ones_like(loss) + grad_out
    }
    assert measure_cpu(nn.Linear(16, 4), linear_x(b), optimizer="sgd").peak_bytes == 96 * b + 552


@pytest.mark.parametrize("b,expected", [(8, 11496), (16, 15208)])
def test_mlp_sgd_momentum(b, expected):
    # Sequential(Linear(16,32), ReLU, Linear(32,8)), SGD momentum=0.9.
    # Before the step: params 3232 + momentum buffers 3232 (one per parameter, same size) + x 64b.
    # Forward: h=addmm 128b (freed after relu), r=relu 128b (saved: relu's and addmm2's backward),
    #          out 32b, loss 4.                               alive: 160b + 4
    # Backward: ones 4, grad_out 32b                          -> 256b + 6472
    #   layer 2: mm grad_r 128b, mm grad_W2 1024, sum grad_b2 32     -> 384b + 7528
    #   grad_out freed (-32b); threshold_backward -> grad_h 128b     -> 480b + 7528   piece 1
    #   r, grad_r freed (-256b); mm grad_W1 2048, sum grad_b1 128    -> 224b + 9704   piece 2
    # Optimizer: in-place mul_/add_ only.
    # b=8: max(480*8 + 7528, 224*8 + 9704) = max(11368, 11496) = 11496
    # b=16: max(15208, 13288) = 15208
    rep = estimator.report(mlp(), linear_x(b), optimizer="sgd-momentum", device="cpu")
    assert sorted(p.bytes.coeffs for p in rep.pieces) == sorted([(7528, 480), (9704, 224)])
    assert rep.peak_bytes == expected
    assert rep.breakdown[C.OPTIMIZER_STATE] == 3232
    assert rep.breakdown[C.GRADIENT] == (3232 if b == 8 else 1024 + 32)  # all grads / layer 2's
    assert measure_cpu(mlp(), linear_x(b), optimizer="sgd-momentum").peak_bytes == expected


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_linear_adam(optimizer):
    # Linear(16, 4): exp_avg 272 + exp_avg_sq 272 + a 4-byte fp32 `step` tensor per parameter
    # (2 parameters) = 552 B of optimizer state.
    # Backward piece (as SGD + state): 96b + 552 + 552 = 96b + 1104.
    # Optimizer piece (weight update): x 64b + out 16b + loss 4 + params 272 + state 552 +
    #   grads 272 + exp_avg_sq.sqrt() 256 + (... / bias_correction2_sqrt) 256 = 80b + 1612
    #   (ones_like and grad_out are freed at the end of backward).
    # At b = 64 the backward piece dominates: 96*64 + 1104 = 7248 > 80*64 + 1612 = 6732.
    b = 64
    rep = estimator.report(nn.Linear(16, 4), linear_x(b), optimizer=optimizer, device="cpu")
    assert rep.peak_bytes == 7248
    assert rep.breakdown[C.OPTIMIZER_STATE] == 2 * 272 + 2 * 4
    assert rep.breakdown[C.GRADIENT] == 272
    assert lin(1104, 96) in [p.bytes for p in rep.pieces]
    (opt_piece,) = [p for p in rep.pieces if p.phase is Phase.OPTIMIZER]
    assert opt_piece.bytes.coeff(1) == 64 + 16  # only x and out scale with b in the update
    assert measure_cpu(nn.Linear(16, 4), linear_x(b), optimizer=optimizer).peak_bytes == 7248


def test_linear_adamw_optimizer_phase_peak_exact():
    # At b = 8 the optimizer piece is the peak: 80*8 + 1612 = 2252 at aten level, plus the 8 B
    # wrapped Python float and its 4 B fp32 copy that the CPU allocator really sees = 2264.
    b = 8
    assert measure_cpu(nn.Linear(16, 4), linear_x(b), optimizer="adamw").peak_bytes == 2264
    rep = estimator.report(nn.Linear(16, 4), linear_x(b), optimizer="adamw", device="cpu")
    assert rep.peak_bytes == 2264


@pytest.mark.parametrize("optimizer", [
    "adagrad",
    "rmsprop",
])
def test_linear_adagrad_rmsprop(optimizer):
    # Adagrad: state_sum (272) + fp32 step (4 per parameter); RMSprop: square_avg (272) + step:
    # both 272 + 2*4 = 280 B of optimizer state.
    # Backward piece: 96b + 552 + 280 = 96b + 832; the update allocates one sqrt (256 for W):
    # 80b + 548 + 280 + 256 = 80b + 1084.  At b = 64: 6976 > 6204.
    b = 64
    rep = estimator.report(nn.Linear(16, 4), linear_x(b), optimizer=optimizer, device="cpu")
    assert rep.breakdown[C.OPTIMIZER_STATE] == 280
    assert rep.peak_bytes == 96 * 64 + 832
    assert measure_cpu(nn.Linear(16, 4), linear_x(b), optimizer=optimizer).peak_bytes == 96 * 64 + 832


def test_callable_optimizer_and_none():
    # A callable factory is the same step as the name; optimizer=None: no state, no update, and
    # the grads are dropped (set to None) after backward: the peak is the backward one.
    b = 8
    by_name = estimator.report(nn.Linear(16, 4), linear_x(b), optimizer="sgd", device="cpu")
    by_callable = estimator.report(nn.Linear(16, 4), linear_x(b), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                                   device="cpu")
    none = estimator.report(nn.Linear(16, 4), linear_x(b), optimizer=None, device="cpu")
    assert by_callable.peak_bytes == by_name.peak_bytes == none.peak_bytes == 96 * b + 552
    assert none.breakdown[C.OPTIMIZER_STATE] == 0
    assert any("optimizer=None" in n for n in none.notes)


# --------------------------------------------------------------------------------------------
# Parameters: frozen, buffers, dtypes, tying


def test_frozen_parameters():
    # Sequential(Linear(16,32) frozen, ReLU, Linear(32,8)), AdamW, b = 16.
    # Trainable: layer 2 only, 1024 + 32 = 1056 B -> gradients 1056, state 2*1056 + 2*4 = 2120.
    # Before the step: params 3232 + state 2120 + x 64b = 64b + 5352.
    # Forward (layer 1 not recorded by autograd): h 128b, r 128b (saved by addmm2), out 32b, loss 4
    #   piece at relu: 64b + 256b + 5352 = 320b + 5352
    # Backward: ones 4, grad_out 32b, mm grad_W2 1024, sum grad_b2 32 (no grad for r: nothing
    #   upstream needs one): 64b + 128b + 32b + 4 + 4 + 32b + 1056 + 5352 = 256b + 6416
    # Optimizer: r and grad_out freed: 96b + 6412, + sqrt 1024 + div 1024 -> 96b + 8460
    # b = 16: max(10472, 10512, 9996) = 10512, in backward, with every gradient alive.
    model = mlp()
    model[0].requires_grad_(False)
    rep = estimator.report(model, linear_x(16), optimizer="adamw", device="cpu")
    assert rep.peak_bytes == 10512
    assert rep.peak_piece.phase is Phase.BACKWARD
    assert rep.breakdown[C.GRADIENT] == 1056
    assert rep.breakdown[C.OPTIMIZER_STATE] == 2120
    assert rep.breakdown[C.PARAMETER] == 3232  # frozen parameters still occupy memory


@pytest.mark.parametrize("mode", ["train", "inference"])
def test_batchnorm_buffers(mode):
    # BatchNorm1d(8): running_mean 8*4 + running_var 8*4 + num_batches_tracked (int64) 8 = 72 B,
    # alive for the whole step whatever the mode.  Parameters: Linear 16*8*4 + 8*4 = 544,
    # BN weight + bias 2*8*4 = 64.
    model = nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8))
    rep = estimator.report(model, linear_x(8), mode=mode, optimizer="sgd", device="cpu")
    assert rep.breakdown[C.BUFFER] == 72
    assert rep.breakdown_formula[C.BUFFER] == Poly.const(72)
    assert rep.breakdown[C.PARAMETER] == 544 + 64
    assert model.training  # report() leaves the user's module as it was


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_halves_bytes(dtype):
    # Linear(16, 4) in a 2-byte dtype with a 2-byte input: every term of 96b + 552 halves
    # (params 136, x 32b, out 8b, loss 2, ones 2, grad_out 8b, grads 128 + 8) = 48b + 276.
    b = 8
    model = nn.Linear(16, 4).to(dtype)
    rep = estimator.report(model, linear_x(b, dtype), optimizer="sgd", device="cpu")
    assert rep.peak_bytes == 48 * b + 276
    assert rep.breakdown[C.PARAMETER] == 136
    assert measure_cpu(nn.Linear(16, 4).to(dtype), linear_x(b, dtype), optimizer="sgd").peak_bytes == 48 * b + 276


class TiedTwice(nn.Module):
    """One 16x16 Parameter (1024 B) applied twice."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        return F.linear(F.linear(x, self.w), self.w)


def test_tied_weight_counted_once_inference():
    # x 64b, h = x W^T 64b, y = h W^T 64b (h alive while y is computed): 1024 + 192b.
    b = 8
    rep = estimator.report(TiedTwice(), linear_x(b), mode="inference", device="cpu")
    assert rep.peak_bytes == 1024 + 192 * b
    assert rep.modules[0].params == 256 and rep.modules[0].param_bytes == 1024


def test_tied_weight_counted_once_train():
    # SGD, b = 8.  params 1024, x 64b.  Forward: h = x W^T 64b (saved by the 2nd use), y 64b,
    # loss 4.  Backward: ones 4, grad_y 64b; 2nd use: grad_h = grad_y W 64b, grad_W(2) 1024
    #   -> piece 1: x, h, y, grad_y, grad_h = 320b; 1024 + 4 + 4 + 1024 = 2056 -> 320b + 2056
    # h, grad_y freed; 1st use: grad_W(1) = grad_h^T x 1024; grad_h freed; autograd sums the two
    # partial gradients of the one Parameter out of place (add: 1024):
    #   -> piece 2: x, y = 128b; 1024 + 4 + 4 + 3*1024 = 4104 -> 128b + 4104
    # b = 8: max(4616, 5128) = 5128.  At the peak one 1024-B gradient (the sum, the future .grad),
    # the two partials are temporaries: counted once as a parameter, once as a gradient.
    b = 8
    rep = estimator.report(TiedTwice(), linear_x(b), optimizer="sgd", device="cpu")
    assert sorted(p.bytes.coeffs for p in rep.pieces) == [(2056, 320), (4104, 128)]
    assert rep.peak_bytes == 5128
    assert rep.breakdown[C.PARAMETER] == 1024
    assert rep.breakdown[C.GRADIENT] == 1024
    assert rep.breakdown[C.TEMPORARY] == 4 + 2 * 1024
    assert measure_cpu(TiedTwice(), linear_x(b), optimizer="sgd").peak_bytes == 5128
    # AdamW keeps one state for the one Parameter: exp_avg 1024 + exp_avg_sq 1024 + step 4.
    adamw = estimator.report(TiedTwice(), linear_x(64), optimizer="adamw", device="cpu")
    assert adamw.breakdown[C.OPTIMIZER_STATE] == 2 * 1024 + 4


# --------------------------------------------------------------------------------------------
# Samples and outputs


def test_same_tensor_under_two_keys_counted_once():
    # {"a": x, "c": x}: one storage, 64b (not 128b).  Inference: l(a) 16b, l(c) 16b, their sum
    # 16b all alive at the add: 272 + 64b + 48b = 112b + 272.
    b = 8
    x = linear_x(b)
    rep = estimator.report(TwoInputs(), {"a": x, "c": x}, mode="inference", device="cpu")
    assert rep.breakdown[C.INPUT] == 64 * b
    assert rep.peak_bytes == 112 * b + 272
    # Two distinct tensors of the same shape are two inputs.
    rep2 = estimator.report(TwoInputs(), {"a": x, "c": x.clone()}, mode="inference", device="cpu")
    assert rep2.breakdown[C.INPUT] == 128 * b


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 8)

    def forward(self, ids):
        return self.emb(ids)


def test_integer_token_ids():
    # ids (b, 6) int64: 48b.  Embedding(100, 8): 100*8*4 = 3200.  Inference: the (b, 6, 8) fp32
    # lookup 192b.  Peak = 3200 + 48b + 192b = 240b + 3200.
    b = 8
    ids = torch.randint(0, 100, (b, 6))
    rep = estimator.report(Bag(), ids, mode="inference", device="cpu")
    assert rep.breakdown[C.INPUT] == 48 * b
    assert rep.peak_bytes == 240 * b + 3200
    assert measure_cpu(Bag(), ids, mode="inference").peak_bytes == 240 * b + 3200
    train = estimator.report(Bag(), ids, optimizer="sgd", device="cpu")
    assert train.peak_bytes == measure_cpu(Bag(), ids, optimizer="sgd").peak_bytes


@dataclasses.dataclass
class HFOutput:
    hidden: torch.Tensor
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class HFStyle(nn.Module):
    """Returns an object whose first floating field is *not* what the loss is computed from."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(16, 8)  # 512 + 32 = 544 B
        self.l2 = nn.Linear(8, 4)  # 128 + 16 = 144 B

    def forward(self, x):
        h = self.l1(x)
        logits = self.l2(h)
        return HFOutput(h, logits, logits.mean())


def test_hf_style_output_loss_is_used():
    # Default loss = output.loss = logits.mean(), SGD, b = 8.  params 688, x 64b.
    # Forward: h 32b (returned, and saved for grad_W2), logits 16b, loss 4.
    # Backward: ones 4, grad_logits 16b; layer 2: mm grad_h 32b, mm grad_W2 128, sum 16
    #   -> 64b + 32b + 16b + 16b + 32b + 688 + 4 + 4 + 144 = 160b + 840
    #   grad_logits freed; layer 1: mm grad_W1 512, sum grad_b1 32
    #   -> 144b + 840 + 544 = 144b + 1384
    # b = 8: max(2120, 2536) = 2536.
    b = 8
    rep = estimator.report(HFStyle(), linear_x(b), optimizer="sgd", device="cpu")
    assert rep.peak_bytes == 144 * b + 1384
    explicit = estimator.report(HFStyle(), linear_x(b), optimizer="sgd", loss_fn=lambda out, s: out.loss, device="cpu")
    assert explicit.peak == rep.peak
    # Had the mean of the first floating field (hidden) been used, layer 2 would get no gradient.
    wrong = estimator.report(HFStyle(), linear_x(b), optimizer="sgd", loss_fn=lambda out, s: out.hidden.mean(),
                             device="cpu")
    assert wrong.peak_bytes != rep.peak_bytes
    assert measure_cpu(HFStyle(), linear_x(b), optimizer="sgd").peak_bytes == 144 * b + 1384


class TupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 4)

    def forward(self, x):
        out = self.l(x)
        return out.argmax(-1), out  # int64 first: the default loss must skip it


def test_tuple_output_default_loss():
    # As the reference Linear case plus argmax (b,) int64 = 8b, alive to the end:
    # 96b + 552 + 8b = 104b + 552.
    b = 8
    rep = estimator.report(TupleOut(), linear_x(b), optimizer="sgd", device="cpu")
    assert rep.peak_bytes == 104 * b + 552
    assert rep.peak == estimator.report(TupleOut(), linear_x(b), optimizer="sgd",
                                        loss_fn=lambda out, s: out[1].mean(), device="cpu").peak
    assert measure_cpu(TupleOut(), linear_x(b), optimizer="sgd").peak_bytes == 104 * b + 552


# --------------------------------------------------------------------------------------------
# Structure of every report


def _cases():
    return {
        "linear-sgd": lambda: estimator.report(nn.Linear(16, 4), linear_x(8), optimizer="sgd", device="cpu"),
        "mlp-momentum": lambda: estimator.report(mlp(), linear_x(8), optimizer="sgd-momentum", device="cpu"),
        "linear-adamw": lambda: estimator.report(nn.Linear(16, 4), linear_x(8), optimizer="adamw", device="cpu"),
        "mlp-inference": lambda: estimator.report(mlp(), linear_x(8), mode="inference", device="cpu"),
        "frozen-adamw": lambda: estimator.report(nn.Sequential(nn.Linear(16, 32).requires_grad_(False),
                                                               nn.ReLU(), nn.Linear(32, 8)), linear_x(5), device="cpu"),
        "hf": lambda: estimator.report(HFStyle(), linear_x(40), optimizer="adam", device="cpu"),
    }


@pytest.fixture(scope="module", params=list(_cases()))
def any_report(request):
    return _cases()[request.param]()


def test_breakdown_sums_to_peak(any_report):
    rep = any_report
    assert set(rep.breakdown) == set(Category)
    assert sum(rep.breakdown.values()) == rep.peak_bytes
    total = Poly()
    for value in rep.breakdown_formula.values():
        total = total + value
    assert total == rep.peak_piece.bytes
    assert rep.peak_piece.bytes(rep.batch) == rep.peak_bytes == rep.at(rep.batch)


def test_pieces_nondominated(any_report):
    # Every piece is the maximum for some batch size in range, and no two pieces are equal.
    rep = any_report
    polys = [p.bytes for p in rep.pieces]
    assert len(set(polys)) == len(polys)
    hi = rep.valid_to if rep.valid_to is not None else rep.valid_from + 100_000
    batches = range(rep.valid_from, hi + 1)
    for p in polys:
        assert any(p(b) == max(q(b) for q in polys) for b in batches), f"{p} is never the peak"
    assert rep.peak_piece.bytes in polys


class Unused(nn.Module):
    """A head the loss never reaches (like BERT's pooler under an MLM loss)."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(16, 4)
        self.unused = nn.Linear(16, 64)

    def forward(self, x):
        return self.used(x)


def test_parameters_without_gradients_get_no_optimizer_state():
    # AdamW creates state only for p.grad is not None: 2 * (64 + 4) floats for `used`,
    # none for `unused` (16*64 + 64 = 1,088 floats, 8,704 B of exp_avg + exp_avg_sq saved).
    b = 4
    rep = estimator.report(Unused(), linear_x(b), optimizer="adamw", device="cpu")
    assert rep.breakdown[Category.OPTIMIZER_STATE] == 2 * 68 * 4 + 2 * 4  # + two 4-B step counters
    assert rep.peak_bytes == measure_cpu(Unused(), linear_x(b), optimizer="adamw").peak_bytes


class Padded(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 16)

    def forward(self, x):
        return F.pad(self.l(x), (0, 3), value=1.0)


def test_constant_pad_keeps_the_batch_symbolic():
    # The fake constant_pad_nd would fix b (Eq(b, 4)); corrections/shapes.py keeps it a symbol.
    # Inference: params 16*16*4 + 16*4 = 1088 B; input 64 B, linear output 64 B and padded
    # output 19*4 = 76 B per row: 204*b + 1088.
    rep = estimator.report(Padded(), linear_x(4), mode="inference", device="cpu")
    assert rep.path is estimator.CapturePath.SYMBOLIC
    assert rep.peak.expand() == 204 * estimator.B + 1088
    for b in (4, 9):
        assert rep.at(b) == measure_cpu(Padded(), linear_x(b), mode="inference").peak_bytes
    train = estimator.report(Padded(), linear_x(4), optimizer="sgd", device="cpu")
    assert train.path is estimator.CapturePath.SYMBOLIC
    assert train.peak_bytes == measure_cpu(Padded(), linear_x(4), optimizer="sgd").peak_bytes
