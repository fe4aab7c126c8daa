"""Rendering a Report: the text table and a JSON-ready dict.  Only this module imports tabulate."""

from __future__ import annotations

import dataclasses
from typing import Any

from tabulate import tabulate

from estimator.reporting.formulas import coefficients, range_text, symbols_text
from estimator.vocab.symbolic import ZERO
from estimator.vocab.units import format_bytes

# Module rows shown in the text table: the model and its children down to this depth.
TABLE_DEPTH = 2


def table(rep) -> str:
    where = f"in the {rep.peak_piece.phase.value} phase at {rep.peak_piece.op}" + (
        f" in {rep.peak_piece.module}" if rep.peak_piece.module else "")
    lines = [
        f"fxmem: {rep.model}, {rep.mode.value}" + (f", optimizer {rep.optimizer}" if rep.optimizer else "")
        + f", b = {rep.batch}" + (f", s = {rep.seq}" if rep.seq is not None else "") + f", {target_text(rep.target)}",
        (f"peak: {format_bytes(rep.peak_bytes)} ({rep.peak_bytes:,} B) {where}" if rep.cuda is None
         else f"peak: {_on_device_text(rep)}\n      the allocated peak is {where}"),
        f"formula (bytes, {rep.path.value} capture, valid for {range_text(rep)}): {rep.peak}",
        *_at_sample_lines(rep),
        "",
    ]
    if rep.ranks:
        worst = next(r for r in rep.ranks if r.report.peak_bytes == rep.peak_bytes)
        lines[1:1] = [(f"strategy: {rep.strategy.describe()} on {rep.strategy.devices} devices; the peak and the "
                       f"tables below are the worst device's: {worst.role} (rank {ranks_text(worst.ranks)})")]
        lines += [_ranks_table(rep), ""]
    elif rep.strategy.describe() != "single device":
        lines[1:1] = [f"strategy: {rep.strategy.describe()}"]
    rows = [
        [category.value, format_bytes(value), f"{value:,}", str(rep.breakdown_formula[category])]
        for category, value in rep.breakdown.items()
        if value or rep.breakdown_formula[category] != ZERO
    ]
    if rep.cuda is None:
        rows.append(["total", format_bytes(rep.peak_bytes), f"{rep.peak_bytes:,}", str(rep.peak_piece.bytes)])
    else:
        rows += _cuda_rows(rep)
    lines.append(tabulate(rows, headers=["at the peak", "size", "bytes", f"formula in {symbols_text(rep)}"], colalign=("left", "right", "right", "left")))
    module_rows = [
        [("  " * m.path.count(".") + (m.path or "(model)")), m.type, f"{m.params:,}", format_bytes(m.param_bytes),
         format_bytes(m.activations(rep.batch)), format_bytes(m.at_peak(rep.batch))]
        for m in rep.modules
        if m.path.count(".") < TABLE_DEPTH - (0 if m.path else 1) or not m.path
    ]
    lines += ["", tabulate(module_rows, headers=["module", "type", "params", "param memory", "activations", "alive at peak"],
                           colalign=("left", "left", "right", "right", "right", "right"))]
    if rep.guards:
        lines += ["", "guards: " + "; ".join(rep.guards)]
    lines += [f"note: {note}" for note in rep.notes]
    return "\n".join(lines)


def _at_sample_lines(rep) -> list[str]:
    """The peak with the sample's data-dependent sizes, beside the bound's."""
    sample = rep.at_sample
    if sample is None:
        return []
    return [f"data-dependent sizes at their upper bound (data_dependent='max', the safe default); at the sample's "
            f"sizes (data_dependent='sample'): peak {format_bytes(sample.peak_bytes)} ({sample.peak_bytes:,} B), "
            f"formula {sample.peak}"]


def target_text(target) -> str:
    """What the prediction is for, as the first line of a report says it: ``"on the CPU"``, or
    ``"on NVIDIA H100 80GB HBM3"`` with, when no ``gpu=`` was given, that this is the default
    GPU."""
    if not target.is_cuda:
        return "on the CPU"
    gpu = target.gpu
    if gpu.taken_for is not None:  # a family name: which variant, and that the memory differs
        text = f"on {gpu.name} ({gpu.describe().removeprefix(gpu.name + ', ')})"
    elif gpu.name.startswith("sm_"):  # an architecture alone
        text = f"on an {gpu.name} GPU"
    elif gpu.name.endswith(" GPU"):  # a memory size alone ("24.00 GiB GPU")
        text = f"on a {gpu.name}"
    else:
        text = f"on {gpu.name}"
    return text + (" (default GPU: pass --gpu / gpu= for yours)" if target.default_gpu else "")


def _on_device_text(rep) -> str:
    """CUDA: the three peaks users read side by side (the table below has their bytes), and the
    device memory's share of the GPU's."""
    device = rep.device_bytes
    total = rep.target.gpu.total_memory
    share = "" if not total else (f" ({100 * device / total:.1f} % of its {format_bytes(total)}"
                                  + ("; does not fit)" if device > total else ")"))
    return (f"{format_bytes(rep.peak_bytes)} allocated, {format_bytes(rep.reserved_bytes)} reserved, "
            f"{format_bytes(device)} on the device{share}")


def _ranks_table(rep) -> str:
    """One row per group of identical ranks: its peak at ``batch`` and its formula."""
    rows = []
    for r in rep.ranks:
        sub = r.report
        row = [r.role, ranks_text(r.ranks), format_bytes(sub.peak_bytes), f"{sub.peak_bytes:,}"]
        if sub.cuda is not None:
            row.append(format_bytes(sub.device_bytes))
        rows.append([*row, str(sub.peak)])
    headers = ["device", "ranks", "peak", "bytes", *(["device memory"] if rep.cuda is not None else []),
               f"peak formula in {symbols_text(rep)}"]
    return tabulate(rows, headers=headers)


def ranks_text(ranks: tuple[int, ...]) -> str:
    """``(0, 1, 2, 3)`` -> ``"0-3"``; short or gapped lists as ``"0, 2"``."""
    if len(ranks) > 2 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _cuda_rows(rep) -> list[list[str]]:
    """The allocator's and libraries' rows under the tensors, with the three totals users read."""
    from estimator.devices.cuda import Overhead

    over = rep.overheads

    def row(label: str, value: int, formula: str = "") -> list[str]:
        return [label, format_bytes(value), f"{value:,}", formula]

    carried = [row(Overhead.PREVIOUS_OUTPUT.value, over[Overhead.PREVIOUS_OUTPUT], "out = model(x) in a loop")]
    return [
        row(Overhead.CUBLAS_WORKSPACE.value, over[Overhead.CUBLAS_WORKSPACE],
            f"{rep.cuda.workspaces} × {rep.cuda.workspace // max(rep.cuda.workspaces, 1):,}"),
        *(carried if rep.cuda.carried else []),
        row(Overhead.ALLOCATOR_ROUNDING.value, over[Overhead.ALLOCATOR_ROUNDING], "512 B blocks"),
        row("= max_memory_allocated", rep.peak_bytes,
            f"≈ {rep.peak_piece.bytes}" + (" + the previous output" if rep.cuda.carried else "")),
        row(Overhead.ALLOCATOR_CACHE.value, over[Overhead.ALLOCATOR_CACHE],
            "pages of expandable segments" if rep.target.allocator.expandable_segments
            else f"{rep.cuda.segments} segments at the end"),
        row("= max_memory_reserved", rep.reserved_bytes,
            f"a run of {rep.cuda.steps} steps; one step after empty_cache(): {rep.cuda.step_reserved:,}"),
        row(Overhead.CUDA_CONTEXT.value + " (estimate)", over[Overhead.CUDA_CONTEXT], "outside the allocator"),
        *([row(Overhead.MANAGED.value, over[Overhead.MANAGED], "paged optimizer state, outside the allocator")]
          if Overhead.MANAGED in over else []),
        row("= device memory (nvidia-smi)", rep.device_bytes),
    ]


def to_dict(rep) -> dict[str, Any]:
    return {
        "model": rep.model,
        "mode": rep.mode.value,
        "device": rep.device,
        "optimizer": rep.optimizer,
        "batch": rep.batch,
        "seq": rep.seq,
        "peak_bytes": rep.peak_bytes,
        "peak": str(rep.peak),
        "pieces": [
            {"bytes": coefficients(p.bytes), "formula": str(p.expr), "phase": p.phase.value, "op": p.op,
             "node": p.node, "module": p.module}
            for p in rep.pieces
        ],
        "peak_at_batch": {"phase": rep.peak_piece.phase.value, "op": rep.peak_piece.op, "module": rep.peak_piece.module},
        "breakdown": {c.value: v for c, v in rep.breakdown.items()},
        "breakdown_formula": {c.value: str(v) for c, v in rep.breakdown_formula.items()},
        "capture": rep.path.value,
        "valid_from": rep.valid_from,
        "valid_to": rep.valid_to,
        "guards": list(rep.guards),
        "modules": [
            {"path": m.path, "type": m.type, "params": m.params, "param_bytes": m.param_bytes,
             "activation_bytes": m.activations(rep.batch), "at_peak_bytes": m.at_peak(rep.batch)}
            for m in rep.modules
        ],
        "notes": list(rep.notes),
        "at_sample": None if rep.at_sample is None else {
            "peak_bytes": rep.at_sample.peak_bytes, "peak": str(rep.at_sample.peak),
            "pieces": [coefficients(p.bytes) for p in rep.at_sample.pieces]},
        "strategy": rep.strategy.describe(),
        "multiple": rep.multiple,
        "ranks": [
            {"role": r.role, "ranks": list(r.ranks), "peak_bytes": r.report.peak_bytes, "peak": str(r.report.peak),
             "pieces": [coefficients(p.bytes) for p in r.report.pieces],
             "breakdown": {c.value: v for c, v in r.report.breakdown.items()},
             "device_bytes": r.report.device_bytes}
            for r in rep.ranks
        ],
        "cuda": None if rep.cuda is None else {
            "gpu": rep.target.gpu.name,
            "default_gpu": rep.target.default_gpu,  # no gpu= given: the first line says so
            "max_memory_allocated": rep.peak_bytes,
            "max_memory_reserved": rep.reserved_bytes,
            "device_bytes": rep.device_bytes,
            "overheads": {k.value: v for k, v in rep.overheads.items()},
            "cublas_workspaces": rep.cuda.workspaces,
            "segments": rep.cuda.segments,
            "run_steps": rep.cuda.steps,
            "run_repeated": rep.cuda.repeated,
            "step_max_memory_allocated": rep.cuda.step_allocated,
            "step_max_memory_reserved": rep.cuda.step_reserved,
        },
        "generation": None if rep.generation is None else {
            **dataclasses.asdict(rep.generation), "peak_in": rep.generation.where,
            "kv_cache_bytes": rep.generation.kv_bytes(rep.batch)},
    }
