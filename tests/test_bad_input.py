"""Bad inputs raise InputError (or CaptureError) whose message names the problem; never a raw
torch exception."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import estimator
from estimator import CaptureError, FxmemError, InputError
from tests.models import TwoInputs


def lin():
    return nn.Linear(16, 4)


def x8():
    return torch.randn(8, 16)


@pytest.mark.parametrize("model,match", [
    (lambda x: x, "nn.Module"),
    (None, "nn.Module"),
    (torch.randn(3), "nn.Module"),
])
def test_not_a_module(model, match):
    with pytest.raises(InputError, match=match):
        estimator.report(model, x8(), device="cpu")


@pytest.mark.parametrize("sample,match", [
    ("abc", "sample must be a tensor"),
    ((1, 2), "no tensor"),
    ({}, "no tensor"),
    ({"a": 1.0}, "no tensor"),
    (torch.tensor(1.0), "scalar"),
    (3.0, "sample must be a tensor"),
])
def test_bad_sample(sample, match):
    with pytest.raises(InputError, match=match):
        estimator.report(lin(), sample, device="cpu")


@pytest.mark.parametrize("sample,names", [
    ((torch.randn(8, 16), torch.randn(5, 16)), ("[0]: 8", "[1]: 5")),
    ({"a": torch.randn(8, 16), "c": torch.randn(5, 16)}, ("['a']: 8", "['c']: 5")),
])
def test_sample_batch_disagrees(sample, names):
    with pytest.raises(InputError, match="disagree") as err:
        estimator.report(TwoInputs(), sample, device="cpu")
    for name in names:
        assert name in str(err.value)


@pytest.mark.parametrize("batch", [0, -1, 2.5, True, "8"])
def test_bad_batch(batch):
    with pytest.raises(InputError, match=f"batch must be a positive int, got {batch!r}"):
        estimator.report(lin(), x8(), batch=batch, device="cpu")


@pytest.mark.parametrize("mode", ["training", "eval", "", None])
def test_bad_mode(mode):
    with pytest.raises(InputError, match="mode must be 'train', 'inference' or 'generate'"):
        estimator.report(lin(), x8(), mode=mode, device="cpu")


@pytest.mark.parametrize("device", ["tpu", "mps", "cuda:0x"])
def test_bad_device(device):
    with pytest.raises(InputError, match=f"device must be one of .*{device}"):
        estimator.report(lin(), x8(), device=device)


def test_unknown_optimizer_lists_known_names():
    with pytest.raises(InputError, match="unknown optimizer 'lion'") as err:
        estimator.report(lin(), x8(), optimizer="lion", device="cpu")
    for known in ("sgd", "sgd-momentum", "adam", "adamw", "adagrad", "rmsprop"):
        assert known in str(err.value)


def test_optimizer_of_wrong_type():
    with pytest.raises(InputError, match="optimizer must be None, a name"):
        estimator.report(lin(), x8(), optimizer=3, device="cpu")


def test_optimizer_factory_returning_garbage():
    with pytest.raises(InputError, match="not a torch.optim.Optimizer"):
        estimator.report(lin(), x8(), optimizer=lambda params: "adam", device="cpu")


@pytest.mark.parametrize("loss_fn,match", [
    (lambda out, s: out, r"scalar tensor, got shape \(8, 4\)"),
    (lambda out, s: 1.0, "scalar tensor, got float"),
    (lambda out, s: out.detach().mean(), "does not require grad"),
    ("mse", "loss_fn must be callable"),
])
def test_bad_loss_fn(loss_fn, match):
    with pytest.raises(InputError, match=match):
        estimator.report(lin(), x8(), loss_fn=loss_fn, device="cpu")


@pytest.fixture(scope="module")
def linear_report():
    return estimator.report(nn.Linear(16, 4), torch.randn(8, 16), optimizer="sgd", device="cpu")


@pytest.mark.parametrize("budget,match", [
    ("eighty GB", "cannot parse the memory size 'eighty GB'"),
    ("-5GiB", "'-5GiB'"),
    ("", "cannot parse the memory size ''"),
    ("5 XB", "'5 XB'"),
    ("80 GiBs", "'80 GiBs'"),
    (0, "must be positive"),
    (-1, "must be positive"),
    (None, "give a budget"),  # only a CUDA report with a known GPU has a default
    (True, "budget must be bytes"),
])
def test_unparseable_budget(linear_report, budget, match):
    with pytest.raises(InputError, match=match):
        linear_report.max_batch(budget)
    with pytest.raises(InputError, match=match):
        linear_report.fits(budget)


@pytest.mark.parametrize("b", [0, -3, 2.5, True])
def test_bad_at(linear_report, b):
    with pytest.raises(InputError, match="positive int"):
        linear_report.at(b)


def test_all_parameters_frozen_in_train():
    model = lin().requires_grad_(False)
    with pytest.raises(InputError, match="no parameter requires grad"):
        estimator.report(model, x8(), device="cpu")
    # optimizer=None reaches the loss check instead: same diagnosis, other words
    with pytest.raises(InputError, match=r"\(are all parameters frozen"):
        estimator.report(model, x8(), optimizer=None, device="cpu")
    # inference of a frozen model is fine
    assert estimator.report(model, x8(), mode="inference", device="cpu").peak_bytes == 80 * 8 + 272


class NonZero(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 4)

    def forward(self, x):
        kept = x[x > 0]  # data-dependent size
        return self.l(kept.reshape(-1, 16))


class ItemIf(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 4)

    def forward(self, x):
        if (x.sum() > 0).item():  # data-dependent Python control flow (a bool: no default value)
            return self.l(x)
        return -self.l(x)


@pytest.mark.parametrize("mode", ["train", "inference"])
def test_data_dependent_models_are_captured(mode):
    """Since issue 11 these capture: the mask's size takes its upper bound (noted), the
    ``.item()`` its value on the sample (a real forward); tests/test_datadep.py checks bytes."""
    rep = estimator.report(NonZero(), x8(), mode=mode, device="cpu")
    assert any("data-dependent size" in n for n in rep.notes)
    assert estimator.report(ItemIf(), x8(), mode=mode, device="cpu").peak_bytes > 0


class WeightsIf(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 4)

    def forward(self, x):
        h = self.l(x)
        if (h.sum() > 0).item():  # a value that follows the weights
            return h
        return -h


def test_data_dependent_value_on_meta_weights_says_why():
    with torch.device("meta"):
        model = WeightsIf()
    with pytest.raises(CaptureError, match="meta device") as err:
        estimator.report(model, x8(), mode="inference", device="cpu")
    assert isinstance(err.value, FxmemError)
    assert "if (h.sum() > 0).item():" in str(err.value) and __file__ in str(err.value)  # the user's line


def test_a_value_that_follows_the_sample_needs_no_weights():
    """``(x.sum() > 0).item()`` reads the sample alone: known on the meta device too, and the
    branch the real run takes (``-self.l(x)``: one more output) is the one estimated."""
    with torch.device("meta"):
        model = ItemIf()
    x = x8().abs()  # the sum is positive: the first branch
    assert estimator.report(model, x, mode="inference", device="cpu").peak_bytes == \
        estimator.report(ItemIf(), x, mode="inference", device="cpu").peak_bytes
    assert estimator.report(model, -x, mode="inference", device="cpu").peak_bytes > \
        estimator.report(model, x, mode="inference", device="cpu").peak_bytes


def test_model_that_raises_names_the_line():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(16, 4)

        def forward(self, x):
            return self.l(x.view(-1, 15))  # wrong reshape

    with pytest.raises(FxmemError) as err:
        estimator.report(Broken(), x8(), device="cpu")
    assert "x.view(-1, 15)" in str(err.value)


def test_uninitialised_lazy_modules_are_named():
    model = nn.Sequential(nn.LazyLinear(32), nn.ReLU(), nn.LazyLinear(4))
    with pytest.raises(InputError, match="lazy modules.*model\\(sample\\)"):
        estimator.report(model, x8(), device="cpu")
    with torch.no_grad():
        model(x8())  # initialised: now an ordinary model
    assert estimator.report(model, x8(), device="cpu").peak_bytes > 0
