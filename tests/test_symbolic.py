"""The peak formula in ``b``: consistent with fresh captures, exactly invertible, honest about
its range of validity, and right outside it (b = 1, concrete fallback)."""

from __future__ import annotations

import functools

import pytest
import sympy
import torch
from torch import nn

import estimator
import models_zoo
from estimator import CapturePath, InputError
from validators.cpu import measure_cpu

ZOO = ["mlp", "gpt", "resnet"]
MODES = ["train", "inference"]


@functools.lru_cache(maxsize=None)
def zoo_report(name: str, mode: str, batch: int):
    """One report per (model, mode, batch), shared by the tests of this module."""
    model, make_sample, loss_fn = models_zoo.get(name, "debug")
    return estimator.report(model, make_sample(8), batch=batch, mode=mode, optimizer="adamw", loss_fn=loss_fn)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ZOO)
@pytest.mark.parametrize("b", [3, 17, 40])
def test_formula_matches_fresh_capture(name, mode, b):
    # The formula captured at b = 8 evaluated at b equals a capture made at b itself.
    rep8 = zoo_report(name, mode, 8)
    assert rep8.path is CapturePath.SYMBOLIC
    assert rep8.at(b) == zoo_report(name, mode, b).peak_bytes


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ZOO)
def test_peak_is_sympy_in_b(name, mode):
    rep = zoo_report(name, mode, 8)
    assert isinstance(rep.peak, sympy.Expr)
    assert rep.peak.free_symbols == {estimator.B}
    assert int(rep.peak.subs(estimator.B, 8)) == rep.peak_bytes == rep.at(8)
    assert int(rep.peak.subs(estimator.B, 123)) == rep.at(123)


@pytest.mark.parametrize("budget", ["1MiB", "3MiB", "20MiB", "1.5 GiB", 3_000_000, 50_000_000])
@pytest.mark.parametrize("name,mode", [("mlp", "train"), ("gpt", "train"), ("resnet", "inference")])
def test_max_batch_exact(name, mode, budget):
    rep = zoo_report(name, mode, 8)
    limit = estimator.parse_bytes(budget)
    k = rep.max_batch(budget)
    if k == 0:  # nothing fits: not even the smallest batch of the range
        assert rep.at(rep.valid_from) > limit
    else:
        assert k >= rep.valid_from
        assert rep.at(k) <= limit < rep.at(k + 1)
        assert rep.fits(budget, k) and not rep.fits(budget, k + 1)


def test_max_batch_nothing_fits():
    rep = zoo_report("gpt", "train", 8)
    assert rep.max_batch(1000) == 0  # 1000 B is less than the parameters alone


# --------------------------------------------------------------------------------------------
# Guards: shape-dependent Python control flow


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 4)

    def forward(self, x):
        if x.shape[0] < 16:
            return self.l(x)
        return self.l(x) * 2  # one more (b, 4) tensor


def test_guard_bounds_small_branch():
    # Captured at b = 8 the model takes the `b < 16` branch: the formula holds for 2 <= b <= 15.
    rep = estimator.report(Branchy(), torch.randn(8, 16), optimizer="sgd")
    assert (rep.valid_from, rep.valid_to) == (2, 15)
    assert any("16" in g for g in rep.guards)
    # Same step as a plain Linear(16, 4): 96b + 552 (see test_exact).
    assert rep.at(15) == 96 * 15 + 552
    for b in (16, 40):
        with pytest.raises(InputError, match=rf"b <= 15.*batch={b}"):
            rep.at(b)
    with pytest.raises(InputError, match="2 <= b"):
        rep.at(1)
    assert rep.max_batch("1GiB") == 15  # clamped to the range


def test_guard_bounds_large_branch():
    rep = estimator.report(Branchy(), torch.randn(20, 16), optimizer="sgd")
    assert rep.valid_from == 16 and rep.valid_to is None
    with pytest.raises(InputError, match="16 <= b"):
        rep.at(15)
    assert rep.at(40) == estimator.report(Branchy(), torch.randn(40, 16), optimizer="sgd").peak_bytes
    assert rep.at(40) == measure_cpu(Branchy(), torch.randn(40, 16), optimizer="sgd").peak_bytes


def test_batch_outside_captured_branch_is_recaptured():
    # Sample at b = 8 (small branch) but batch=30 asked: the number must be the large branch's.
    rep = estimator.report(Branchy(), torch.randn(8, 16), batch=30, optimizer="sgd")
    assert rep.batch_outside_range
    assert rep.peak_bytes == measure_cpu(Branchy(), torch.randn(30, 16), optimizer="sgd").peak_bytes
    assert rep.peak_bytes == estimator.report(Branchy(), torch.randn(30, 16), optimizer="sgd").peak_bytes


# --------------------------------------------------------------------------------------------
# The concrete fallback


class Specializes(nn.Module):
    """``int(x.shape[0])`` specializes the symbolic batch size: the symbolic capture fails, fake
    runs at concrete sizes work."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 4)

    def forward(self, x):
        n = int(x.shape[0])
        return self.l(x) * torch.ones(n, 1)


@pytest.mark.parametrize("mode", MODES)
def test_concrete_fallback_matches_fresh_capture(mode):
    rep = estimator.report(Specializes(), torch.randn(8, 16), mode=mode, optimizer="sgd")
    assert rep.path is CapturePath.CONCRETE
    assert any("symbolic capture failed" in n for n in rep.notes)
    for b in (17, 40):
        fresh = estimator.report(Specializes(), torch.randn(b, 16), mode=mode, optimizer="sgd")
        assert rep.at(b) == fresh.peak_bytes
        assert rep.at(b) == measure_cpu(Specializes(), torch.randn(b, 16), mode=mode, optimizer="sgd").peak_bytes


class LSTMModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)

    def forward(self, x):
        return self.lstm(x)[0]


@pytest.mark.parametrize("mode", MODES)
def test_lstm_concrete_fallback(mode):
    # nn.LSTM cannot run with a symbolic batch (at::native::lstm calls numel()): the report
    # must come from the concrete fallback and agree with a fresh capture at another batch.
    rep = estimator.report(LSTMModel(), torch.randn(8, 5, 8), mode=mode, optimizer="sgd")
    assert rep.path is CapturePath.CONCRETE
    assert rep.at(17) == estimator.report(LSTMModel(), torch.randn(17, 5, 8), mode=mode, optimizer="sgd").peak_bytes


def test_zoo_rnn_uses_concrete_fallback():
    model, make_sample, loss_fn = models_zoo.get("rnn", "debug")
    rep = estimator.report(model, make_sample(8), loss_fn=loss_fn, mode="inference")
    assert rep.path is CapturePath.CONCRETE
    assert rep.valid_from == 8


# --------------------------------------------------------------------------------------------
# b = 1 (outside the symbolic range b >= 2)


def test_batch_one_linear():
    # Linear(16, 4), SGD: 96b + 552 holds at b = 1 too: 648.
    rep = estimator.report(nn.Linear(16, 4), torch.randn(1, 16), optimizer="sgd")
    assert rep.batch_outside_range
    assert rep.peak_bytes == 96 + 552
    assert measure_cpu(nn.Linear(16, 4), torch.randn(1, 16), optimizer="sgd").peak_bytes == 648


@pytest.mark.parametrize("name,mode", [("mlp", "inference"), ("gpt", "inference"), ("gpt", "train")])
def test_batch_one_zoo(name, mode):
    model, make_sample, loss_fn = models_zoo.get(name, "debug")
    rep = estimator.report(model, make_sample(1), mode=mode, optimizer="adamw", loss_fn=loss_fn)
    assert rep.batch == 1
    model2, make_sample2, loss_fn2 = models_zoo.get(name, "debug")
    measured = measure_cpu(model2, make_sample2(1), mode=mode, optimizer="adamw", loss_fn=loss_fn2).peak_bytes
    assert rep.peak_bytes == measured
