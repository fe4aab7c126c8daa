"""``python -m validators.steps``: users' own training steps (``report(step=fn)``, the patterns of
``models_zoo.steps``) against the same steps measured on CPU; writes the "Your own step"
section of docs/validation.md.

Each row: ``estimator.report(model, sample, step=fn, optimizer=state_factory)`` on a fresh model
against ``validators.cpu.measure_user_step`` on another (one unmeasured step, then the measured
one; the bytes alive when it starts measured too).  Also the built-in step with the output
dropped before backward (``keep_output=False``) over zoo models.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import estimator
import models_zoo
from models_zoo import steps
from validators.cpu import measure_cpu, measure_user_step
from validators.strategies import kept_section, write_section

MARKS = ("<!-- steps -->", "<!-- /steps -->")
BATCHES = (4, 32)
KEEP_OUTPUT_MODELS = ("gpt", "bert", "vit", "lstm_lm", "llama")


@dataclass(frozen=True)
class Row:
    case: str
    batch: int
    predicted: int
    measured: int

    @property
    def error(self) -> float:
        return 100 * (self.predicted - self.measured) / self.measured


def run_case(name: str, batch: int) -> Row:
    case = steps.CASES[name]
    rep = estimator.report(case.make_model(), case.make_sample(batch), step=case.step, optimizer=case.optimizer,
                           mode=case.mode, device="cpu")
    measured = measure_user_step(case.make_model(), case.make_sample(batch), case.step, case.optimizer, case.mode)
    return Row(name, batch, rep.peak_bytes, measured.peak_bytes)


def run_dropped_output(name: str, batch: int) -> Row:
    """The built-in step with ``keep_output=False`` on a zoo model's debug size."""
    model, make_sample, loss_fn = models_zoo.get(name, "debug")
    rep = estimator.report(model, make_sample(batch), loss_fn=loss_fn, keep_output=False, device="cpu")
    model, make_sample, loss_fn = models_zoo.get(name, "debug")
    measured = measure_cpu(model, make_sample(batch), loss_fn=loss_fn, keep_output=False)
    return Row(f"{name} (debug), built-in step, keep_output=False", batch, rep.peak_bytes, measured.peak_bytes)


def rows(only: str | None = None):
    for name in steps.CASES:
        if only is None or only.lower() in name.lower():
            for b in BATCHES:
                yield run_case(name, b)
    for name in KEEP_OUTPUT_MODELS:
        if only is None or only.lower() in name.lower():
            for b in BATCHES:
                yield run_dropped_output(name, b)


def to_markdown(found: list[Row], command: str) -> str:
    errors = [abs(r.error) for r in found]
    lines = [
        MARKS[0],
        "## Your own step (`report(step=fn)`)",
        "",
        ("The training loops of `models_zoo/steps.py` (patterns of real loops the built-in step does not cover), "
         "each predicted with `estimator.report(model, sample, step=fn, optimizer=state_factory)` and measured "
         "by running the same function on real tensors (`validators.cpu.measure_user_step`: one unmeasured step, "
         "then the measured one; the bytes alive when it starts are measured too, not listed). Then the built-in "
         "step with the model output dropped before backward (`keep_output=False`, as Hugging Face's Trainer, "
         "Lightning and torchtitan do) over zoo models."),
        "",
        f"Reproduce: `{command}`",
        "",
        (f"**{len(found)} cases: median |error| {statistics.median(errors):.3f} %, max |error| {max(errors):.3f} %.**"),
        "",
        "| step | b | predicted (B) | measured (B) | error |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {r.case} | {r.batch} | {r.predicted:,} | {r.measured:,} | {r.error:+.3f} % |" for r in found]
    return "\n".join(lines) + "\n" + MARKS[1] + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validators.steps", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="run the cases whose name contains this text (does not write the docs)")
    parser.add_argument("--markdown", type=Path, default=Path("docs/validation.md"))
    parser.add_argument("--json", type=Path, default=Path("docs/validation-steps.json"))
    args = parser.parse_args(argv)
    found = []
    for row in rows(args.only):
        print(f"{row.case:55s} b={row.batch:<3d} predicted {row.predicted:>12,} measured {row.measured:>12,} "
              f"{row.error:+.3f} %", flush=True)
        found.append(row)
    if args.only is None:
        write_section(args.markdown, to_markdown(found, "python -m validators.steps"), MARKS)
        args.json.write_text(json.dumps([asdict(r) | {"error_pct": r.error} for r in found], indent=1) + "\n")
    return 0


def kept(path: Path) -> str:
    """This section of ``path`` ('' if none): what ``python -m validators`` keeps."""
    return kept_section(path, MARKS)


if __name__ == "__main__":
    sys.exit(main())
