"""Plots of a Report (estimator.reporting.plot): what is drawn, in which units, where the marks are."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import estimator
from estimator import Category, InputError, format_bytes
from estimator.reporting import plot

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def rep():
    # Linear(16, 4) + SGD at b = 8: peak 96 b + 552 B (tests/test_exact.py derives it by hand).
    return estimator.report(nn.Linear(16, 4), torch.randn(8, 16), optimizer="sgd", device="cpu")


class Branchy(nn.Module):
    """A batch-size branch: the formula holds for 2 <= b <= 15 only."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 4)

    def forward(self, x):
        return self.l(x) if x.shape[0] < 16 else self.l(x) + 1


@pytest.fixture(scope="module")
def guarded():
    return estimator.report(Branchy(), torch.randn(8, 16), optimizer=None, device="cpu")


def _line(ax, label):
    found = [line for line in ax.get_lines() if line.get_label() == label]
    assert found, f"no line {label!r} among {[line.get_label() for line in ax.get_lines()]}"
    return found[0]


def test_unit_for():
    assert plot.unit_for(3 * 2**30) == ("GiB", 2**30)
    assert plot.unit_for(2**30) == ("GiB", 2**30)
    assert plot.unit_for(2**30 - 1) == ("MiB", 2**20)
    assert plot.unit_for(1000) == ("KiB", 2**10)


def test_timeline_values_peak_is_the_reports(rep):
    values = plot.timeline_values(rep)
    assert max(values["peaks"]) == rep.peak_bytes == 96 * 8 + 552
    assert values["peaks"][values["peak_index"]] == rep.peak_bytes
    assert max(plot.timeline_values(rep, 32)["peaks"]) == rep.at(32) == 96 * 32 + 552
    # stacked categories add up to the op's live total
    for i, op in enumerate(rep.timeline.ops):
        assert sum(values["live"][c][i] for c in Category) == op.total(8)


def test_timeline_figure(rep):
    fig = plot.plot_timeline(rep)
    ax = fig.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    for category in (Category.PARAMETER, Category.INPUT, Category.GRADIENT, Category.ACTIVATION):
        assert category.value in labels
    assert Category.OPTIMIZER_STATE.value not in labels  # plain SGD keeps no state: not drawn
    texts = [t.get_text() for t in ax.texts]
    assert {"forward", "backward", "optimizer"} <= set(texts)
    assert any(t.startswith(f"peak {format_bytes(rep.peak_bytes)}") for t in texts)
    assert ax.get_ylabel() == "live memory (KiB)"  # 1320 B
    assert "b = 8" in ax.get_title()
    png = io.BytesIO()
    fig.savefig(png, format="png")  # no pyplot, no display needed
    assert png.getvalue().startswith(b"\x89PNG")


def test_timeline_measured_points(rep):
    n = len(rep.timeline.ops)
    fig = plot.plot_timeline(rep, measured=[(0, 600), (0.5, 1000), (1.0, 1320)])
    line = _line(fig.axes[0], "measured")
    assert list(line.get_xdata()) == [0, 0.5 * (n - 1), n - 1]  # int: op index; float: fraction
    assert list(line.get_ydata()) == pytest.approx([600 / 1024, 1000 / 1024, 1320 / 1024])
    with pytest.raises(InputError, match="fraction"):
        plot.plot_timeline(rep, measured=[(1.5, 100)])


def test_timeline_on_given_axes_and_out_of_range(rep):
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot()
    assert plot.plot_timeline(rep, 16, ax=ax) is fig
    assert "b = 16" in ax.get_title()
    with pytest.raises(InputError, match="b=1"):
        plot.plot_timeline(rep, 1)


def test_peak_vs_batch_budget(rep):
    budget = 10_000  # 96 b + 552 <= 10000  <=>  b <= 98
    fit = rep.max_batch(budget)
    assert fit == 98
    batches = plot.default_batches(rep, budget)
    assert batches[0] == rep.valid_from and batches[-1] > fit and {fit, fit + 1} <= set(batches)
    fig = plot.plot_peak_vs_batch(rep, budget=budget, measured={4: 96 * 4 + 552, 8: 1320})
    ax = fig.axes[0]
    curve = _line(ax, "predicted peak")
    assert list(curve.get_xdata()) == batches
    assert list(curve.get_ydata()) == pytest.approx([rep.at(b) / 1024 for b in batches])
    assert list(_line(ax, f"budget {format_bytes(budget)}").get_ydata()) == pytest.approx([budget / 1024] * 2)
    assert list(_line(ax, "largest batch that fits: 98").get_xdata()) == [98]
    assert list(_line(ax, "measured").get_xdata()) == [4, 8]


def test_peak_vs_batch_range_end(guarded):
    assert guarded.valid_to == 15
    assert plot.default_batches(guarded) == list(range(2, 16))
    fig = plot.plot_peak_vs_batch(guarded, batches=range(1, 40))  # 1 and 16.. are outside the formula
    ax = fig.axes[0]
    assert list(_line(ax, "predicted peak").get_xdata()) == list(range(2, 16))
    _line(ax, "formula holds up to b = 15")
    with pytest.raises(InputError, match="no batch size"):
        plot.plot_peak_vs_batch(guarded, batches=[20, 30])


def test_peak_vs_batch_many_points_and_no_fit(rep):
    batches = plot.default_batches(rep, "1GiB")  # the largest batch is in the millions
    fit = rep.max_batch("1GiB")
    assert len(batches) <= plot.MAX_POINTS + 3 and {rep.batch, fit, fit + 1} <= set(batches)
    fig = plot.plot_peak_vs_batch(rep, budget=500)  # not even b = 2 fits
    assert any("does not fit" in t.get_text() for t in fig.axes[0].texts)


def test_cuda_report_draws_the_allocator_view():
    if not hasattr(estimator.Report, "on_device"):
        pytest.skip("this estimator has no CUDA allocator view")
    rep = estimator.report(nn.Linear(16, 4), torch.randn(8, 16), optimizer="sgd", device="cuda")
    device = rep.on_device(8)
    fig = plot.plot_timeline(rep)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert f"max_memory_allocated {format_bytes(device.allocated)}" in labels
    assert f"max_memory_reserved {format_bytes(device.reserved)}" in labels
    fig = plot.plot_peak_vs_batch(rep, budget="1GiB")
    ax = fig.axes[0]
    curve = _line(ax, "device memory used (predicted)")
    assert len(curve.get_xdata()) <= plot.MAX_POINTS_CUDA + 3
    fit = rep.max_batch("1GiB")
    assert list(_line(ax, f"largest batch that fits: {fit:,}").get_ydata()) == pytest.approx(
        [rep.on_device(fit).device / 2**30])  # the axis is in GiB (the budget)
