"""What users naturally give fxmem (issue 11): real tensors that are not faked, a batch that is
not dim 0, hooks and objects that must stay untouched, quiet captures, and the spellings users
write.  Validation tests compare with a real CPU measurement (``validators.cpu.measure_cpu``)
and are exact to the byte unless stated."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import estimator
from estimator import CaptureError, InputError
from estimator.capture import steps
from estimator.cli import cli
from estimator.cli.options import batch_dims
from estimator.vocab.categories import Category
from estimator.vocab.units import parse_bytes
from validators.cpu import measure_cpu

# A module-level constant used in forward: created at import, never faked by the copy.
OFFSET = torch.randn(16)  # 16 float32 = 64 B
SEEN: list = []  # a module-level list a hook appends to


class Helper:
    """A non-Module object holding a tensor."""

    def __init__(self):
        self.scale = torch.randn(16)  # 64 B


class Holder(nn.Module):
    """Tensors in a list, a dict, on a helper object, and a module-level constant."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 4)
        self.shifts = [torch.randn(16)]  # 64 B
        self.biases = {"out": torch.randn(4)}  # 16 B
        self.helper = Helper()  # 64 B

    def forward(self, x):
        return self.l(x * self.helper.scale + self.shifts[0] + OFFSET) + self.biases["out"]


# -- A. tensors that are not faked ----------------------------------------------------------
@pytest.mark.parametrize("mode", ["train", "inference"])
def test_tensors_held_outside_parameters_and_module_constants(mode):
    torch.manual_seed(0)
    model, x = Holder(), torch.randn(8, 16)
    rep = estimator.report(model, x, mode=mode, device="cpu")
    measured = measure_cpu(model, x, mode=mode)
    # The measurement's baseline counts the model's state (the held tensors are buffers there
    # too: steps.state_tensors) but not OFFSET, which lives outside the model: 64 B more.
    assert rep.peak_bytes == measured.peak_bytes + OFFSET.numel() * 4
    # Buffers at the peak: shifts 64 + biases 16 + helper.scale 64 + OFFSET 64 = 208 B.
    assert rep.breakdown[Category.BUFFER] == 208
    notes = " ".join(rep.notes)
    for name in ("shifts[0]", "biases['out']", "helper.scale", "144 B in all", "OFFSET (16,) float32, 64 B",
                 "counted as a buffer"):
        assert name in notes
    assert type(model.shifts[0]) is torch.Tensor and type(OFFSET) is torch.Tensor


def test_loss_closing_over_a_real_target():
    torch.manual_seed(0)
    model, x, target = nn.Linear(16, 4), torch.randn(8, 16), torch.randn(8, 4)

    def loss_fn(out, sample):
        return ((out - target) ** 2).mean()

    rep = estimator.report(model, x, loss_fn=loss_fn, device="cpu")
    assert rep.path is estimator.CapturePath.SYMBOLIC
    # The target has the sample's batch size: an input of 16 B per row, like the sample's 64 B.
    for b in (2, 8, 32):
        assert rep.breakdown_formula[Category.INPUT](b) == (64 + 16) * b
    measured = measure_cpu(model, x, loss_fn=loss_fn)
    assert rep.peak_bytes == measured.peak_bytes + target.numel() * 4  # the measurement's baseline omits it
    assert "target (8, 4) float32, 128 B" in " ".join(rep.notes) and "follows b" in " ".join(rep.notes)
    assert type(target) is torch.Tensor


# -- B. quiet capture ------------------------------------------------------------------------
def test_shape_mismatch_prints_nothing(capfd):
    with pytest.raises(CaptureError, match="same reduction dim"):
        estimator.report(nn.Linear(16, 4), torch.randn(8, 15), device="cpu")
    out, err = capfd.readouterr()
    assert out == "" and err == ""  # torch logged ~160 lines at ERROR before


class ItemScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 4)

    def forward(self, x):
        return self.l(x) * x.abs().max().item()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile imports dynamo, which warns
def test_item_and_compiled_module_leak_no_warning():
    model = nn.Linear(16, 4)
    wrapped = torch.compile(model)  # an OptimizedModule
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        estimator.report(ItemScale(), torch.randn(8, 16), device="cpu")
        compiled = estimator.report(wrapped, torch.randn(8, 16), device="cpu")
    assert [str(w.message) for w in caught] == []
    assert any("estimated as compiled" in n for n in compiled.notes)
    assert compiled.model == "Linear"


class Warns(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 4)

    def forward(self, x):
        warnings.warn("the user's own warning")
        return self.l(x)


def test_the_users_own_warnings_still_reach_them():
    with pytest.warns(UserWarning, match="the user's own warning"):
        estimator.report(Warns(), torch.randn(8, 16), device="cpu")


# -- C. batch not in dim 0 -------------------------------------------------------------------
class SeqFirst(nn.Module):
    """nn.LSTM is sequence-first by default: input (seq, batch, features)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(8, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out)


def test_sequence_first_lstm_without_batch_dims_is_noted():
    rep = estimator.report(SeqFirst(), torch.randn(10, 4, 8), mode="inference", device="cpu")
    assert rep.batch == 10  # dim 0: the sequence length, as the note says
    assert any("LSTM 'rnn' is sequence-first" in n and "batch_dims=1" in n for n in rep.notes)


@pytest.mark.parametrize("b", [4, 12])
def test_sequence_first_lstm_with_batch_dims_matches_measurement(b):
    torch.manual_seed(0)
    model = SeqFirst()
    rep = estimator.report(model, torch.randn(10, 4, 8), batch=b, batch_dims=1, device="cpu")
    assert rep.batch == b
    assert not any("sequence-first" in n for n in rep.notes)
    assert rep.peak_bytes == measure_cpu(model, torch.randn(10, b, 8)).peak_bytes


def test_batch_dims_split_by_gradient_accumulation(monkeypatch):
    """Accumulation splits the named dim (the measurement's step gets the same batch_dims)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)  # batch_first=False
    x = torch.randn(10, 4, 16)
    strategy = estimator.Strategy(accumulate=2)
    rep = estimator.report(layer, x, batch_dims=1, strategy=strategy, device="cpu")
    assert rep.batch == 4 and rep.path is estimator.CapturePath.SYMBOLIC
    run = steps.run
    monkeypatch.setattr(steps, "run", lambda *a, **k: run(*a, **k, batch_dims=(1,)))
    assert rep.peak_bytes == measure_cpu(layer, x, strategy=strategy).peak_bytes
    halves = steps.micro_batches(x, 2, (1,))
    assert [tuple(h.shape) for h in halves] == [(10, 2, 16)] * 2


class DictSeq(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, src, mask):
        return self.l(src).sum(-1).t() * mask  # src (seq, batch, 8), mask (batch, seq)


def test_batch_dims_addressing_and_errors():
    sample = {"src": torch.randn(10, 4, 8), "mask": torch.ones(4, 10)}
    rep = estimator.report(DictSeq(), sample, mode="inference", batch_dims={"src": 1}, device="cpu")
    assert rep.batch == 4
    rep = estimator.report(DictSeq(), sample, mode="inference", batch_dims={"src": 1},
                           dynamic={"src": {0: "s"}, "mask": {1: "s"}}, device="cpu")
    assert (rep.batch, rep.seq) == (4, 10)
    with pytest.raises(InputError, match=r"disagree on the batch size \(their batch_dims\)"):
        estimator.report(DictSeq(), sample, batch_dims={"src": 1, "mask": 1}, device="cpu")
    with pytest.raises(InputError, match=r"batch_dims\['src'\] = 3 is not a dim"):
        estimator.report(DictSeq(), sample, batch_dims={"src": 3}, device="cpu")
    with pytest.raises(InputError, match="batch_dims names 'tgt', which the sample does not have"):
        estimator.report(DictSeq(), sample, batch_dims={"tgt": 1}, device="cpu")
    with pytest.raises(InputError, match="batch_dims must be an int"):
        estimator.report(nn.Linear(8, 8), torch.randn(4, 8), batch_dims={0: 1}, device="cpu")
    with pytest.raises(InputError, match="dim 1 is the batch"):
        estimator.report(DictSeq(), sample, batch_dims={"src": 1}, dynamic={"src": {1: "s"}}, device="cpu")


def test_cli_batch_dim(tmp_path):
    assert batch_dims(("1",)) == 1
    assert batch_dims(("src:1", "0:0")) == {"src": 1, 0: 0}
    with pytest.raises(InputError, match="not both"):
        batch_dims(("1", "src:1"))
    source = tmp_path / "seqfirst.py"
    source.write_text("import torch\n"
                      "def make():\n"
                      "    return torch.nn.LSTM(8, 16), torch.randn(10, 4, 8)\n")
    result = CliRunner().invoke(cli, ["report", f"{source}:make", "--batch-dim", "1", "--mode", "inference",
                                      "--json", "-q"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["batch"] == 4


# -- D. smaller traps ------------------------------------------------------------------------
class Grows(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 4)
        self.register_buffer("seen", torch.zeros(0, 16))
        self.history = []

    def forward(self, x):
        self.seen = torch.cat([self.seen, x.detach().mean(0, keepdim=True)])
        self.history.append(x.detach())
        return self.l(x)


class CachesOnce(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 4)
        self.cache = None

    def forward(self, x):
        if self.cache is None:
            self.cache = torch.ones(16)
        return self.l(x * self.cache)


@pytest.mark.parametrize("mode", ["train", "inference"])
def test_memory_that_grows_every_step_is_noted(mode):
    rep = estimator.report(Grows(), torch.randn(8, 16), mode=mode, device="cpu")
    # Each step adds a 16-float row to `seen` (64 B) and the (8, 16) input to `history` (512 B).
    assert any("grows with every step" in n and "576 B more after each step at b = 8" in n for n in rep.notes)
    once = estimator.report(CachesOnce(), torch.randn(8, 16), mode=mode, device="cpu")
    assert not any("grows" in n for n in once.notes)


def test_optimizer_in_inference_is_ignored_with_a_note_in_api_and_cli():
    rep = estimator.report(nn.Linear(16, 4), torch.randn(8, 16), mode="inference", optimizer="sgd", device="cpu")
    assert rep.optimizer is None
    assert "optimizer='sgd' is ignored: inference has no optimizer step" in rep.notes
    plain = estimator.report(nn.Linear(16, 4), torch.randn(8, 16), mode="inference", device="cpu")  # default optimizer
    assert not any("ignored" in n for n in plain.notes) and plain.peak_bytes == rep.peak_bytes
    result = CliRunner().invoke(cli, ["report", "mlp", "--mode", "inference", "--optimizer", "sgd", "-q"])
    assert result.exit_code == 0, result.output
    assert "optimizer='sgd' is ignored" in result.stdout


def test_too_few_pipeline_stages_comes_first():
    model = nn.Sequential(nn.Linear(16, 4), nn.Linear(4, 4))
    with pytest.raises(InputError, match=r"Strategy\(pipeline=5\) needs at least 5 blocks"):
        estimator.report(model, torch.randn(8, 16), strategy=estimator.Strategy(pipeline=5), device="cpu")


@pytest.mark.parametrize("budget", ["-1GiB", "-0.5 GB", -1.0])
def test_negative_budget_is_called_negative(budget):
    with pytest.raises(InputError, match="must be positive"):
        parse_bytes(budget)


# -- E. the user's objects untouched; wrong inputs fail as for real --------------------------
def test_user_hooks_run_on_the_copy():
    torch.manual_seed(0)
    store = {"outs": []}
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    model[0].register_forward_hook(lambda module, args, out: store["outs"].append(out))  # a closure's dict
    model[2].register_forward_pre_hook(lambda module, args: SEEN.append(args[0].clone()))  # a global list
    try:
        rep = estimator.report(model, torch.randn(8, 16), device="cpu")
        assert store == {"outs": []} and SEEN == []  # nothing fake in the user's objects
        # The hooks ran in the fake run: the outputs they keep alive are counted, as measured.
        plain = estimator.report(nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)), torch.randn(8, 16),
                                 device="cpu")
        assert rep.peak_bytes > plain.peak_bytes
        assert rep.peak_bytes == measure_cpu(model, torch.randn(8, 16)).peak_bytes
    finally:
        SEEN.clear()


def test_global_module_hooks_are_not_run():
    seen = []
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, out: seen.append(out))
    try:
        rep = estimator.report(nn.Linear(16, 4), torch.randn(8, 16), device="cpu")
    finally:
        handle.remove()
    assert seen == []
    assert any("1 global module hook(s)" in n for n in rep.notes)


@pytest.mark.parametrize("model,match", [
    (nn.Linear(16, 4), "addmm needs one dtype but gets float32 and float64"),
    (nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 4).double()), "native_layer_norm needs one dtype"),
])
@pytest.mark.parametrize("mode", ["train", "inference"])
def test_sample_dtype_not_the_models_fails_as_for_real(model, match, mode):
    x = torch.randn(8, 16, dtype=torch.float64)
    with pytest.raises(Exception):  # the real run fails
        model(x)
    with pytest.raises(InputError, match=match):
        estimator.report(model, x, mode=mode, device="cpu")


class BatchNormCumulative(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4, momentum=None)  # cumulative average: reads num_batches_tracked

    def forward(self, x):
        return self.bn(self.conv(x))


def test_batchnorm_momentum_none_trains():
    torch.manual_seed(0)
    model, x = BatchNormCumulative(), torch.randn(4, 3, 8, 8)
    rep = estimator.report(model, x, device="cpu")
    assert int(model.bn.num_batches_tracked) == 0  # the fake run's counter is a copy
    assert rep.peak_bytes == measure_cpu(model, x).peak_bytes
    with torch.device("meta"):
        on_meta = BatchNormCumulative()
    assert estimator.report(on_meta, x, device="cpu").peak_bytes == rep.peak_bytes  # no real run needed


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_budget(budget):
    rep = estimator.report(nn.Linear(16, 4), torch.randn(8, 16), optimizer="sgd", device="cpu")
    with pytest.raises(InputError, match="memory size"):
        rep.max_batch(budget)
    with pytest.raises(InputError, match="memory size"):
        rep.fits(budget)


@pytest.mark.filterwarnings("ignore:`torch.jit.script:DeprecationWarning")
def test_scripted_module_is_refused():
    with pytest.raises(InputError, match="scripted or traced module.*pass the eager module"):
        estimator.report(torch.jit.script(nn.Linear(16, 4)), torch.randn(8, 16), device="cpu")
    with pytest.raises(InputError, match="module '0' is a torch.jit scripted or traced module \\(RecursiveScriptModule\\)"):
        estimator.report(nn.Sequential(torch.jit.script(nn.Linear(16, 4))), torch.randn(8, 16), device="cpu")


def test_optimizer_factory_that_raises_is_named():
    def make_optimizer(params):
        raise RuntimeError("no such learning rate")

    with pytest.raises(InputError, match="optimizer factory .*make_optimizer raised RuntimeError: no such learning "
                                         "rate") as err:
        estimator.report(nn.Linear(16, 4), torch.randn(8, 16), optimizer=make_optimizer, device="cpu")
    assert "the model could not be run" not in str(err.value)


def test_what_users_naturally_write_is_accepted():
    model, x = nn.Linear(16, 4), torch.randn(8, 16)
    base = estimator.report(model, x, batch=8, device="cpu")
    assert estimator.report(model, x, batch=np.int64(8), device="cpu").peak_bytes == base.peak_bytes
    assert estimator.report(model, x, mode="TRAIN", device="cpu").peak_bytes == base.peak_bytes
    assert estimator.report(model, x, mode="Inference", device="cpu").mode is estimator.Mode.INFERENCE
    cuda = estimator.report(model, x, device="cuda:1")
    assert cuda.peak_bytes == estimator.report(model, x, device=torch.device("cuda", 0)).peak_bytes
    assert estimator.report(model, x, device="CUDA").device == "cuda"
    upper = estimator.report(model, x, amp="BF16", device="cpu")
    assert upper.peak_bytes == estimator.report(model, x, amp="bf16", device="cpu").peak_bytes
    assert base.at(np.int64(8)) == base.peak_bytes
    assert base.max_batch(np.int64(10**6)) == base.max_batch(10**6)
    assert base.max_batch(np.float64(1e6)) == base.max_batch(10**6)
    with pytest.raises(InputError, match="device must be one of"):
        estimator.report(model, x, device="cuda:x")
    result = CliRunner().invoke(cli, ["report", "mlp", "--mode", "TRAIN", "--device", "CUDA:1", "--amp", "BF16",
                                      "--json", "-q"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["device"] == "cuda"


@pytest.mark.parametrize("batch", [2, 17])
def test_a_sample_keeps_its_layout(batch):
    """A dense sample tensor is captured with its own strides (it was made contiguous): a
    channels-last image takes the convolutions' channels-last path (+8,736 B over at b = 3 for one
    Conv2d before), a transposed sequence batch the linear's matmul path (-640 B under at b = 2)."""

    def loss(out, x):
        return out.mean()

    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 1))
    image = torch.randn(batch, 3, 10, 10).contiguous(memory_format=torch.channels_last)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    sequences = torch.randn(10, batch, 8).transpose(0, 1)  # (b, 10, 8), strides (8, 8b, 1)
    for model, x in ((conv, image), (mlp, sequences)):
        rep = estimator.report(model, x, loss_fn=loss, device="cpu")
        assert rep.path is estimator.CapturePath.SYMBOLIC
        assert rep.peak_bytes == measure_cpu(model, x, loss_fn=loss).peak_bytes
