"""Progress of long work (``vocab/progress.py``, ``estimator.progress()``): the library is silent
unless asked; the capture reports each op it records, the host-kernel measurements each call
they run, ``compare``/``plan`` each step; the bars are tqdm's, drawn on the file given."""

from __future__ import annotations

import io

import torch
from torch import nn

import estimator
from estimator import progress_bars
from estimator.orchestrate.estimate import estimate_each
from estimator.vocab import progress as seam


class _Recorded:
    """A reporter that keeps every bar it hands out."""

    def __init__(self):
        self.bars = []

    def __call__(self, description, total, unit):
        bar = _Bar(description, total, unit)
        self.bars.append(bar)
        return bar

    def named(self, prefix: str) -> list:
        return [b for b in self.bars if b.description.startswith(prefix)]


class _Bar:
    def __init__(self, description, total, unit):
        self.description, self.total, self.unit, self.n, self.closed = description, total, unit, 0, False

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        self.closed = True


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_silent_unless_asked(capsys):
    estimator.report(_mlp(), torch.randn(4, 8), optimizer="sgd", device="cpu")
    assert capsys.readouterr() == ("", "")
    assert seam._REPORTER.get() is None
    with estimator.progress(show=None, file=io.StringIO()):  # not a terminal: no bars
        assert seam._REPORTER.get() is None


def test_capture_reports_every_op_it_records():
    recorded = _Recorded()
    with seam.reporting(recorded):
        rep = estimator.report(_mlp(), torch.randn(4, 8), optimizer="sgd", device="cpu")
    (capture,) = recorded.named("capture")
    assert (capture.n, capture.unit, capture.closed) == (len(rep.timeline.ops), "op", True)
    assert seam._REPORTER.get() is None  # restored


def test_accounting_and_the_allocator_replay_report_their_ops():
    """After the capture, a long ``generate()``'s million ops take seconds to account and to replay
    through the caching-allocator model: each reports the ops it walks.  The replay walks the ops
    that allocate or free (``_Plan.program``, the end of the step one more) once per step it
    replays: the run's steps, and the benchmark protocol's second step."""
    from estimator.devices import cuda, cuda_run

    recorded = _Recorded()
    with seam.reporting(recorded):
        rep = estimator.report(_mlp(), torch.randn(4, 8), optimizer="sgd", device="cuda")
    (accounting,) = recorded.named("accounting")
    assert (accounting.n, accounting.total, accounting.unit, accounting.closed) == \
        (len(rep.timeline.ops), len(rep.timeline.ops), "op", True)
    (replay,) = recorded.named("CUDA caching-allocator replay")
    program = cuda_run._Plan(rep.timeline, rep.batch, [(i, 0) for i in cuda.cublas_first_uses(rep.timeline)]).program
    assert (replay.n, replay.unit, replay.closed) == ((rep.cuda.steps + 1) * len(program), "op", True)


def test_host_kernels_and_comparisons_report_their_units(tmp_path, monkeypatch):
    """A GroupNorm on the CPU target is measured on the host: on an empty cache every distinct call
    runs once, each a unit of the bar; ``estimate_each`` (compare/plan) counts its steps."""
    from estimator.corrections.cpu import host

    monkeypatch.setenv("FXMEM_CACHE_DIR", str(tmp_path))  # an empty cache
    monkeypatch.setattr(host, "CACHE", host._Cache())
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8))
    recorded = _Recorded()
    with seam.reporting(recorded):
        estimate_each({"sgd": estimator.Request(model, torch.randn(2, 3, 8, 8), optimizer="sgd", device="cpu"),
                       "adam": estimator.Request(model, torch.randn(2, 3, 8, 8), optimizer="adam", device="cpu")},
                      workers=1)  # the kernels measured here (workers measure theirs silently)
    kernels = recorded.named("kernels measured on this host")
    assert kernels and all(b.n == b.total > 0 and b.unit == "call" for b in kernels)
    (steps,) = recorded.named("steps of the comparison")
    assert (steps.n, steps.total, steps.closed) == (2, 2, True)


def test_bars_are_drawn_on_the_file(monkeypatch):
    monkeypatch.setattr(progress_bars, "DELAY", 0)
    out = io.StringIO()
    with estimator.progress(file=out):
        estimator.report(_mlp(), torch.randn(4, 8), optimizer="sgd", device="cpu")
    assert "fxmem: capture" in out.getvalue()
