"""The Report as an object: its text, its dict, its graph; report() leaves the model alone;
meta-device models; byte units."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json

import pytest
import torch
from torch import fx, nn

import estimator
import models_zoo
from estimator import Category, format_bytes, parse_bytes


@pytest.fixture(scope="module")
def linear_report():
    # Linear(16, 4), SGD, b = 8: peak 96*8 + 552 = 1320 B (see test_exact).
    return estimator.report(nn.Linear(16, 4), torch.randn(8, 16), optimizer="sgd", device="cpu")


def test_report_is_estimate_of_a_request():
    """``report(model, sample, **options)`` is ``estimate(Request(model, sample, **options))``: one
    request object, its fields report()'s keywords (which follow the first two arguments)."""
    params = inspect.signature(estimator.report).parameters
    assert [f.name for f in dataclasses.fields(estimator.Request)] == list(params)
    assert {n: p.default for n, p in params.items() if p.kind is p.KEYWORD_ONLY} == {
        f.name: f.default for f in dataclasses.fields(estimator.Request) if f.name not in ("model", "sample")}
    assert all(p.kind is p.KEYWORD_ONLY for n, p in params.items() if n not in ("model", "sample"))
    model, x = nn.Linear(16, 4), torch.randn(8, 16)
    request = estimator.Request(model, x, batch=32, optimizer="sgd", device="cpu")
    assert estimator.estimate(request).to_json() == estimator.report(model, x, batch=32, optimizer="sgd",
                                                                      device="cpu").to_json()
    assert request.replace(batch=4).batch == 4 and request.batch == 32
    with pytest.raises(TypeError, match="positional"):
        estimator.report(model, x, 32)


def test_str_has_peak_formula_and_categories(linear_report):
    text = str(linear_report)
    assert "1,320" in text and "1.29 KiB" in text  # 1320 / 1024 = 1.289...
    assert "96*b + 552" in text
    for category in (Category.PARAMETER, Category.INPUT, Category.GRADIENT, Category.ACTIVATION,
                     Category.TEMPORARY):
        assert category.value in text
    assert "total" in text
    assert "Linear" in text and "sgd" in text


def test_str_shows_guards_and_notes():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(16, 4)

        def forward(self, x):
            return self.l(x) if x.shape[0] < 16 else self.l(x) + 1

    text = str(estimator.report(Branchy(), torch.randn(8, 16), optimizer=None, device="cpu"))
    assert "b < 16" in text and "b ≤ 15" in text
    assert "optimizer=None" in text


def test_to_dict_is_json(linear_report):
    d = linear_report.to_dict()
    loaded = json.loads(json.dumps(d))
    for key in ("peak_bytes", "peak", "breakdown", "pieces", "modules"):
        assert key in loaded
    assert loaded["peak_bytes"] == 1320
    assert loaded["peak"] == "96*b + 552"
    assert sum(loaded["breakdown"].values()) == 1320
    assert loaded["breakdown"]["parameters"] == 272
    assert loaded["pieces"][0]["bytes"] == [552, 96]
    assert loaded["modules"][0]["param_bytes"] == 272


def test_to_dict_of_a_zoo_model_is_json():
    model, make_sample, loss_fn = models_zoo.get("tied_autoencoder", "debug")
    d = estimator.report(model, make_sample(4), loss_fn=loss_fn, device="cpu").to_dict()
    assert json.loads(json.dumps(d))["peak_bytes"] == d["peak_bytes"]


def test_graph_is_aten(linear_report):
    # The brief specified an fx.GraphModule; commit 9316638 ("own recorder instead of make_fx")
    # made Report.graph an fx.Graph (estimator/reporting/result.py).  Both expose .nodes.
    graph = linear_report.graph
    assert isinstance(graph, (fx.Graph, fx.GraphModule))
    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    ops = [t for t in targets if isinstance(t, torch._ops.OpOverload)]
    assert ops, "no aten op in the graph"
    assert all(t.namespace == "aten" for t in ops), {str(t) for t in ops}
    names = {str(t) for t in ops}
    assert {"aten.addmm.default", "aten.mean.default", "aten.mm.default"} <= names
    # every other call_function is shape arithmetic on SymInts, not a tensor op
    others = [t for t in targets if not isinstance(t, torch._ops.OpOverload)]
    assert all(getattr(t, "__module__", "") in ("_operator", "operator", "torch", "math") for t in others), others
    # nodes carry fxmem's per-op memory: the live bytes after addmm are 64b + 272 + 16b
    (addmm,) = [n for n in graph.nodes if str(n.target) == "aten.addmm.default"]
    assert addmm.meta["fxmem"]["live"] == 80 * estimator.B + 272


def test_report_does_not_modify_the_model():
    model, make_sample, loss_fn = models_zoo.get("bert", "debug")
    model.eval()  # report(mode="train") must not flip it
    params = dict(model.named_parameters())
    values = {n: p.detach().clone() for n, p in params.items()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    flags = {n: m.training for n, m in model.named_modules()}
    estimator.report(model, make_sample(4), mode="train", optimizer="adamw", loss_fn=loss_fn, device="cpu")
    assert dict(model.named_parameters()) == params  # same objects
    for n, p in model.named_parameters():
        assert p.device.type == "cpu" and torch.equal(p, values[n]) and p.grad is None
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n])
    assert {n: m.training for n, m in model.named_modules()} == flags


def test_report_does_not_modify_sample_or_batchnorm_stats():
    model = nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8))
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(8, 16)
    x_before = x.clone()
    estimator.report(model, x, mode="train", device="cpu")
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(x, x_before)
    assert model.training


@pytest.mark.parametrize("mode", ["train", "inference"])
def test_meta_device_model(mode):
    real, make_sample, loss_fn = models_zoo.get("gpt", "debug")
    meta, _, _ = models_zoo.get("gpt", "debug", device="meta")
    assert all(p.device.type == "meta" for p in meta.parameters())
    rep_real = estimator.report(real, make_sample(8), mode=mode, loss_fn=loss_fn, device="cpu")
    rep_meta = estimator.report(meta, make_sample(8), mode=mode, loss_fn=loss_fn, device="cpu")
    assert rep_meta.peak_bytes == rep_real.peak_bytes
    assert rep_meta.peak == rep_real.peak


def test_cuda_device_predicts_the_allocator(linear_report):
    rep = estimator.report(nn.Linear(16, 4), torch.randn(8, 16), optimizer="sgd", device="cuda")
    # The same 9 tensors as on CPU are alive at the peak (weight 256 B, bias 16, input 512, out 128,
    # loss 4, grad_out 4 and 128, weight/bias grads 256 and 16 B): 1,320 B, each in a 512-byte
    # block on CUDA, plus two 32 MiB cuBLAS workspaces (forward thread, autograd thread; H100).
    assert rep.device == "cuda" and sum(rep.breakdown.values()) == linear_report.peak_bytes == 1320
    assert rep.peak_bytes == 9 * 512 + 2 * 32 * 2**20
    assert any("CUDA target" in n for n in rep.notes)


def test_module_rows(linear_report):
    (row,) = linear_report.modules
    assert (row.path, row.type, row.params, row.param_bytes) == ("", "Linear", 68, 272)
    # out (16b) + loss (4) are the forward allocations alive when backward starts
    assert row.activations(8) == 16 * 8 + 4


@pytest.mark.parametrize("text,expected", [
    ("1.5 GiB", 1610612736),  # 1.5 * 2**30
    ("40 GB", 40 * 10**9),
    ("80GiB", 80 * 2**30),
    ("512MiB", 512 * 2**20),
    ("512 mib", 512 * 2**20),
    ("2K", 2048),
    ("1000", 1000),
    (" 3 kB ", 3000),
    (4096, 4096),
    (1.5, 1),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("n,expected", [
    (0, "0 B"),
    (1023, "1023 B"),
    (1536, "1.50 KiB"),
    (2**20, "1.00 MiB"),
    (1610612736, "1.50 GiB"),
    (3 * 2**40, "3.00 TiB"),
])
def test_format_bytes(n, expected):
    assert format_bytes(n) == expected


@pytest.mark.gpu
def test_cuda_available_for_gpu_marker():
    assert torch.cuda.is_available()


def test_every_batch_up_to_max_batch_fits():
    """Reserved memory is not monotonic in b: the 8 sizes below the bisection's answer are replayed
    too.  The device takes 10·m + 5, but 110 at m = 7 (a segment rounded up): with a limit of 100,
    m = 8 fits (85) but 7 does not, so the answer is 6, whose 8 sizes below are checked again."""
    from estimator.reporting.result import every_smaller_fits

    checked = []

    def device(m):
        checked.append(m)
        return 110 if m == 7 else 10 * m + 5

    assert every_smaller_fits(8, 2, device, 100) == 6
    assert checked[:7] == [8, 7, 6, 5, 4, 3, 2] and 7 not in checked[7:]
    assert every_smaller_fits(30, 2, lambda m: 200 if m < 10 else 5, 100) == 30  # 9 is 21 below: not looked at
    assert every_smaller_fits(3, 2, lambda m: 200, 100) == 0
    # over the limit by e bytes: the answer moves down by ceil(e / per_row) rows at once.  10·m
    # against 1,000 from m = 200: 200 is over by 1,000 = 100 rows, so 100 (exactly 1,000) is
    # next, and its 8 sizes below: 10 replays where one size at a time took about a hundred.
    checked.clear()
    assert every_smaller_fits(200, 2, lambda m: checked.append(m) or 10 * m, 1000, per_row=10) == 100
    assert checked == [200, *range(100, 91, -1)]
