"""Plots of a Report: live memory op by op through the step, and the peak against the batch size.

matplotlib is imported when a function is called (``pip install 'fxmem[plot]'``).  Each function
draws on a new ``matplotlib.figure.Figure`` (not pyplot's global state, so nothing opens a window
and many figures can be made in a loop) or on the ``ax`` it is given, and returns the Figure;
nothing is shown or printed.  Bytes stay bytes until they are drawn: the axes are in KiB, MiB or
GiB (powers of two), whichever suits the largest value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from estimator.account import CATEGORIES
from estimator.vocab.categories import Category, Phase
from estimator.vocab.errors import InputError
from estimator.vocab.units import GiB, KiB, MiB, format_bytes, parse_bytes

# One colour per category (matplotlib's tab10), the same in every plot.
COLORS = {
    Category.PARAMETER: "#1f77b4",
    Category.BUFFER: "#17becf",
    Category.INPUT: "#7f7f7f",
    Category.GRADIENT: "#ff7f0e",
    Category.OPTIMIZER_STATE: "#9467bd",
    Category.ACTIVATION: "#2ca02c",
    Category.KV_CACHE: "#bcbd22",
    Category.TEMPORARY: "#d62728",
}
PHASE_COLORS = {Phase.FORWARD: "#1f77b4", Phase.BACKWARD: "#ff7f0e", Phase.OPTIMIZER: "#9467bd"}
MAX_POINTS = 400  # batch sizes drawn on a peak-vs-batch curve (all of them when fewer)
MAX_POINTS_CUDA = 40  # the same for a CUDA report: each point is an allocator replay


def _figure(ax, size=(9.0, 4.5)):
    """``(figure, ax)``: ``ax``'s own, or a new Figure not registered with pyplot."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("fxmem's plots need matplotlib: pip install 'fxmem[plot]'") from exc
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.add_subplot()


def unit_for(nbytes: float) -> tuple[str, int]:
    """The unit an axis reaching ``nbytes`` is drawn in: ``("GiB", 2**30)``, MiB or KiB."""
    for name, size in (("GiB", GiB), ("MiB", MiB)):
        if abs(nbytes) >= size:
            return name, size
    return "KiB", KiB


def _check_b(rep, b: int | None) -> int:
    """``b`` (default ``rep.batch``) where the timeline's formulas hold; InputError elsewhere."""
    b = rep.batch if b is None else b
    try:
        rep.at(b)
    except InputError as exc:
        raise InputError(f"cannot draw the step at b={b}: {exc}") from None
    return b


def timeline_in_b(rep):
    """The report's timeline in ``b`` only (a formula also in the sequence length ``s`` is taken at
    the sample's ``s``)."""
    timeline, seq = rep.timeline, getattr(rep, "seq", None)
    return timeline.at_s(seq) if seq is not None and hasattr(timeline, "at_s") else timeline


def _cuda(rep) -> bool:
    """A CUDA report with the allocator's view (``rep.on_device``)."""
    return getattr(rep, "cuda", None) is not None


def _phase_runs(phases: Sequence[Phase]) -> list[tuple[Phase, int, int]]:
    """Maximal runs of one phase: ``(phase, first op, last op)``."""
    runs: list[tuple[Phase, int, int]] = []
    for i, phase in enumerate(phases):
        if runs and runs[-1][0] is phase:
            runs[-1] = (phase, runs[-1][1], i)
        else:
            runs.append((phase, i, i))
    return runs


def _measured_points(measured, n_ops: int) -> list[tuple[float, int]]:
    """``(x, bytes)`` pairs: an int x is an op index, a float x a fraction of the step (0..1)."""
    points = []
    for x, nbytes in measured:
        if isinstance(x, float):
            if not 0.0 <= x <= 1.0:
                raise InputError(f"a measured point's float position is a fraction of the step (0..1), got {x}")
            x = x * max(n_ops - 1, 0)
        points.append((x, int(nbytes)))
    return points


def timeline_values(rep, b: int | None = None) -> dict[str, Any]:
    """The numbers ``plot_timeline`` draws, in bytes: ``live`` (one list per category, one value
    per op), ``peaks`` (live plus the op's largest kernel scratch), ``phases``, ``peak_index``."""
    b = _check_b(rep, b)
    ops = timeline_in_b(rep).ops
    live = {c: [op.live[k](b) for op in ops] for k, c in enumerate(CATEGORIES)}
    peaks = [max(p(b) for p in op.peaks()) for op in ops]
    peak_index = max(range(len(peaks)), key=peaks.__getitem__) if peaks else None
    return {"b": b, "live": live, "peaks": peaks, "phases": [op.phase for op in ops], "peak_index": peak_index}


def plot_timeline(rep, b: int | None = None, ax=None, measured: Iterable[tuple[float, int]] | None = None):
    """Predicted live memory after every op of the step, stacked by category.

    ``b``: the batch size (default ``rep.batch``; it must lie in the formula's valid range).
    The forward/backward/optimizer phases are shaded and labelled; the peak is marked (kernel
    scratch, when a correction adds any, is the dotted line above the stack).  ``measured``:
    optional ``(x, bytes)`` points drawn on the same axes, ``x`` an op index (int) or a
    fraction of the step (float in 0..1).  Returns the Figure.
    """
    values = timeline_values(rep, b)
    b, peaks, n = values["b"], values["peaks"], len(values["peaks"])
    timeline = timeline_in_b(rep)
    points = _measured_points(measured or (), n)
    device = rep.on_device(b) if _cuda(rep) else None  # CUDA: the allocator's figures at b
    fig, ax = _figure(ax)
    top = max(1, *peaks, *(p[1] for p in points), sum(v(b) for v in timeline.baseline),
              *((device.allocated, device.reserved) if device else ()))
    unit, scale = unit_for(top)
    xs = list(range(n))

    shown = [c for c in CATEGORIES if any(values["live"][c])]
    if n:
        ax.stackplot(
            xs, *[[v / scale for v in values["live"][c]] for c in shown],
            labels=[c.value for c in shown], colors=[COLORS[c] for c in shown], step="post", linewidth=0,
        )
        totals = [op.total(b) for op in timeline.ops]
        if any(p != t for p, t in zip(peaks, totals)):
            ax.plot(xs, [p / scale for p in peaks], ":", color="black", linewidth=0.8, drawstyle="steps-post",
                    label="with kernel scratch")
        for phase, first, last in _phase_runs(values["phases"]):
            ax.axvspan(first - 0.5, last + 0.5, color=PHASE_COLORS.get(phase, "gray"), alpha=0.07, linewidth=0)
            narrow = (last - first + 1) < 0.08 * n  # too narrow for the word: written upwards
            ax.text((first + last) / 2, 0.98, phase.value, transform=ax.get_xaxis_transform(), ha="center",
                    va="top", fontsize=7 if narrow else 8, rotation=90 if narrow else 0,
                    color=PHASE_COLORS.get(phase, "gray"))
        i = values["peak_index"]
        op = timeline.ops[i]
        ax.plot([i], [peaks[i] / scale], marker="v", color="black", markersize=7, linestyle="none")
        where = f"{op.op}" + (f" in {op.module}" if op.module else "")
        left = i < n / 2
        ax.annotate(f"peak {format_bytes(peaks[i])}\n{where}", (i, peaks[i] / scale), xytext=(8 if left else -8, 2),
                    textcoords="offset points", ha="left" if left else "right", va="bottom", fontsize=8)
    if device is not None:  # the stack is the tensors' bytes; the allocator rounds and caches on top
        ax.axhline(device.allocated / scale, color="black", linestyle="--", linewidth=0.8,
                   label=f"max_memory_allocated {format_bytes(device.allocated)}")
        ax.axhline(device.reserved / scale, color="gray", linestyle="-.", linewidth=0.8,
                   label=f"max_memory_reserved {format_bytes(device.reserved)}")
    if points:
        ax.plot([p[0] for p in points], [p[1] / scale for p in points], "o-", color="black", markersize=4,
                linewidth=1, label="measured")
    ax.set_xlim(-0.5, max(n - 0.5, 0.5))
    ax.set_ylim(0, top / scale * 1.22)
    ax.set_xlabel("op of the step (aten ops, in order)")
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_title(f"{rep.model}: one {rep.mode.value} step at b = {b} (predicted, device {rep.device})", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7,
                  frameon=False)
    return fig


def default_batches(rep, budget: int | None = None) -> list[int]:
    """Batch sizes for ``plot_peak_vs_batch``: up to a bit past the largest batch that fits
    ``budget`` (else up to ``max(4 * rep.batch, 32)``), inside the valid range, at most
    ``MAX_POINTS`` of them (the batch, the largest fitting batch and the one after it included)."""
    lo = rep.valid_from
    special = [rep.batch]
    if budget is not None:
        fit = rep.max_batch(budget)
        hi = max(int(fit * 1.25) + 1, 2 * rep.batch, lo + 8) if fit else max(2 * rep.batch, lo + 8)
        special += [fit, fit + 1]
    else:
        hi = max(4 * rep.batch, 32)
    if rep.valid_to is not None:
        hi = min(hi, rep.valid_to)
    hi = max(hi, lo)
    most = MAX_POINTS_CUDA if _cuda(rep) else MAX_POINTS
    if hi - lo + 1 <= most:
        batches = set(range(lo, hi + 1))
    else:
        step = (hi - lo) / (most - 1)
        batches = {lo + round(i * step) for i in range(most)} | {s for s in special if lo <= s <= hi}
    return sorted(batches)


def _in_range(rep, b: int) -> bool:
    return b >= rep.valid_from and (rep.valid_to is None or b <= rep.valid_to)


def plot_peak_vs_batch(
    rep,
    batches: Iterable[int] | None = None,
    budget: int | str | None = None,
    measured: Mapping[int, int] | Iterable[tuple[int, int]] | None = None,
    ax=None,
):
    """The predicted peak ``rep.at(b)`` against the batch size.

    ``batches``: the batch sizes to draw (default ``default_batches``; those outside the
    formula's valid range are left out, and the end of the range is drawn).  ``budget`` (bytes
    or ``"80GiB"``): a horizontal line, with the largest batch that fits marked.  ``measured``:
    ``{b: bytes}`` (or pairs) drawn as points.  Returns the Figure.
    """
    limit = parse_bytes(budget) if budget is not None else None
    wanted = default_batches(rep, limit) if batches is None else sorted(set(batches))
    xs = [b for b in wanted if not isinstance(b, bool) and isinstance(b, int) and b > 0 and _in_range(rep, b)]
    if not xs:
        upper = "∞" if rep.valid_to is None else rep.valid_to
        raise InputError(f"no batch size to draw in the formula's range {rep.valid_from} <= b <= {upper}")
    ys = [rep.at(b) for b in xs]
    # CUDA: the allocator's reserved memory and the device's (what a budget is compared with)
    on_device = [rep.on_device(b) for b in xs] if _cuda(rep) else []
    points = sorted((measured.items() if isinstance(measured, Mapping) else measured) or ())
    fit = rep.max_batch(limit) if limit is not None else None

    fig, ax = _figure(ax, size=(7.0, 4.5))
    top = max([*ys, *(m.device for m in on_device), *(p[1] for p in points), limit or 0])
    unit, scale = unit_for(top)
    ax.plot(xs, [y / scale for y in ys], "-", color=COLORS[Category.ACTIVATION], linewidth=1.5,
            label="predicted peak" + (f" ({len(rep.pieces)} pieces)" if len(rep.pieces) > 1 else ""))
    if on_device:
        ax.plot(xs, [m.reserved / scale for m in on_device], "--", color="gray", linewidth=1,
                label="max_memory_reserved (predicted)")
        ax.plot(xs, [m.device / scale for m in on_device], "-", color="black", linewidth=1,
                label="device memory used (predicted)")
    if _in_range(rep, rep.batch) and xs[0] <= rep.batch <= xs[-1]:
        ax.plot([rep.batch], [rep.at(rep.batch) / scale], "o", color=COLORS[Category.ACTIVATION], markersize=5)
        ax.annotate(f"b = {rep.batch}: {format_bytes(rep.at(rep.batch))}", (rep.batch, rep.at(rep.batch) / scale),
                    xytext=(6, -12), textcoords="offset points", fontsize=8)
    elif rep.batch_outside_range:
        ax.plot([rep.batch], [rep.peak_bytes / scale], "s", color="gray", markersize=5,
                label=f"b = {rep.batch} (own capture, outside the formula's range)")
    if limit is not None:
        ax.axhline(limit / scale, color="red", linestyle="--", linewidth=1, label=f"budget {format_bytes(limit)}")
        if fit:
            ax.axvline(fit, color="red", linestyle=":", linewidth=1)
            at_fit = rep.on_device(fit).device if on_device else rep.at(fit)
            ax.plot([fit], [at_fit / scale], "v", color="red", markersize=7, label=f"largest batch that fits: {fit:,}")
        else:
            ax.text(0.98, 0.04, f"does not fit at b = {rep.valid_from}", transform=ax.transAxes, color="red",
                    fontsize=8, ha="right")
    if rep.valid_to is not None and xs[-1] >= rep.valid_to:
        ax.axvline(rep.valid_to + 0.5, color="gray", linestyle="-.", linewidth=1,
                   label=f"formula holds up to b = {rep.valid_to}")
    if points:
        ax.plot([p[0] for p in points], [p[1] / scale for p in points], "x", color="black", markersize=7,
                markeredgewidth=1.5, label="measured")
    ax.set_xlabel("batch size b")
    ax.set_ylabel(f"peak memory ({unit})")
    ax.set_ylim(0, top / scale * 1.1)
    ax.set_title(f"{rep.model}: peak of one {rep.mode.value} step (predicted, device {rep.device})", fontsize=10)
    ax.grid(True, linewidth=0.3, alpha=0.5)
    ax.legend(loc="upper left", fontsize=7, framealpha=0.9)
    return fig


def plot_steps(samples: Sequence, budget: int | None = None, warn_at: float | None = None, ax=None):
    """Measured memory of every step (``estimator.monitor.StepSample``s) against the predicted
    peak at each step's batch size, with the budget and the warning level.  Returns the Figure."""
    if not samples:
        raise InputError("no step was recorded: nothing to plot")
    fig, ax = _figure(ax, size=(7.0, 4.5))
    xs = [s.step for s in samples]
    series = [
        ("peak allocated (measured)", [s.peak for s in samples], {"marker": "o", "color": "black", "linestyle": "-"}),
        ("peak reserved (measured)", [s.peak_reserved for s in samples],
         {"marker": "s", "color": "gray", "linestyle": "--"}),
        ("device used (measured)", [s.device_used for s in samples],
         {"marker": "^", "color": "#8c564b", "linestyle": ":"}),
        ("predicted peak", [s.predicted for s in samples],
         {"color": COLORS[Category.ACTIVATION], "linestyle": "-", "linewidth": 2, "alpha": 0.8}),
    ]
    top = max([v for _, ys, _ in series for v in ys if v is not None] + [budget or 0])
    unit, scale = unit_for(top)
    for label, ys, style in series:
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] / scale for p in pts], label=label, markersize=4, **style)
    if budget is not None:
        ax.axhline(budget / scale, color="red", linestyle="--", linewidth=1, label=f"budget {format_bytes(budget)}")
        if warn_at is not None and warn_at < 1:
            ax.axhline(warn_at * budget / scale, color="red", linestyle=":", linewidth=1,
                       label=f"warning at {warn_at:.0%}")
    ax.set_xlabel("step")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_ylim(0, top / scale * 1.15)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title("measured per step", fontsize=10)
    ax.grid(True, linewidth=0.3, alpha=0.5)
    ax.legend(loc="lower right", fontsize=7, framealpha=0.9)
    return fig


def phase_points(rep, sample, b: int) -> list[tuple[int, int]]:
    """A step's measured phases placed on the predicted timeline at ``b``: for the k-th phase of
    a name, ``(first op of the k-th run of that phase, bytes when it began)`` and ``(the op of the
    predicted peak in that run, measured peak of the phase)``.  A step without phase marks is
    placed over the whole timeline."""
    ops = timeline_in_b(rep).ops
    if not ops:
        return []
    runs = _phase_runs([op.phase for op in ops])
    peaks = [max(p(b) for p in op.peaks()) for op in ops]

    def argmax(first: int, last: int) -> int:
        return max(range(first, last + 1), key=peaks.__getitem__)

    marked = [p for p in sample.phases if p.name in {ph.value for ph in Phase}]
    if not marked:
        return [(0, sample.phases[0].start), (argmax(0, len(ops) - 1), sample.peak)]
    seen: dict[str, int] = {}
    points = []
    for p in marked:
        k = seen.get(p.name, 0)
        seen[p.name] = k + 1
        matching = [r for r in runs if r[0].value == p.name]
        if k < len(matching):
            _, first, last = matching[k]
            points += [(first, p.start), (argmax(first, last), p.peak)]
    return sorted(points)


def plot_monitor(monitor, step: int = -1):
    """``MemoryMonitor.plot``: the steps (``plot_steps``) and, with a prediction whose formula holds
    at the step's batch size, that step's phases over the predicted timeline."""
    samples = monitor.samples
    if not samples:
        raise InputError("no step was recorded: nothing to plot")
    sample = samples[step]
    rep = monitor.prediction
    b = sample.batch if sample.batch is not None else getattr(rep, "batch", None)
    with_timeline = rep is not None and b is not None and _in_range(rep, b) and bool(timeline_in_b(rep).ops)
    fig, _ = _figure(None, size=(14.0, 4.5) if with_timeline else (7.0, 4.5))
    fig.clear()
    plot_steps(samples, monitor.budget, monitor.warn_at, ax=fig.add_subplot(1, 2 if with_timeline else 1, 1))
    if with_timeline:
        ax = fig.add_subplot(1, 2, 2)
        plot_timeline(rep, b, ax=ax, measured=phase_points(rep, sample, b))
        ax.set_title(f"step {sample.step} (b = {b}): measured phases on the predicted step", fontsize=10)
    return fig
