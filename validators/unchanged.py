"""``python -m validators.unchanged``: prove a refactor changed no number.

``save DIR`` writes the report JSON of every zoo model (debug size) × {train, inference} × {CPU, CUDA
target} at two batch sizes into DIR, one file per report (``gpt-train-cuda-b8.json``); a report that
is refused is saved as its error message.  ``compare OLD NEW`` lists the reports whose JSON differs
(byte for byte) and exits 1 when one does.  Run ``save`` on the old tree and the new one (a ``git
worktree`` of the old commit works), then ``compare``.  Only the public API is used, so the script
runs unchanged on both sides of a move.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BATCHES = (2, 8)
MODES = ("train", "inference")
DEVICES = ("cpu", "cuda")


def save(out: Path, names: list[str] | None) -> int:
    import estimator
    import models_zoo

    out.mkdir(parents=True, exist_ok=True)
    for name in names or models_zoo.names():
        for mode in MODES:
            for device in DEVICES:
                for b in BATCHES:
                    model, make_sample, loss_fn = models_zoo.get(name, "debug")
                    if mode == "inference":
                        model.eval()
                    try:
                        text = estimator.report(model, make_sample(b), mode=mode, loss_fn=loss_fn,
                                                device=device).to_json()
                    except estimator.FxmemError as err:
                        text = f"{type(err).__name__}: {err}"
                    path = out / f"{name}-{mode}-{device}-b{b}.json"
                    path.write_text(text + "\n")
                    print(path.name, flush=True)
    return 0


def compare(old: Path, new: Path) -> int:
    names = sorted({p.name for p in old.glob("*.json")} | {p.name for p in new.glob("*.json")})
    differ = [n for n in names if not (old / n).exists() or not (new / n).exists()
              or (old / n).read_bytes() != (new / n).read_bytes()]
    for n in differ:
        print("differs:", n)
    print(f"{len(names) - len(differ)} of {len(names)} reports byte-identical")
    return 1 if differ else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validators.unchanged", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_save = sub.add_parser("save", help="write every report's JSON into DIR")
    p_save.add_argument("dir", type=Path)
    p_save.add_argument("--models", nargs="*", help="zoo names (default: all)")
    p_compare = sub.add_parser("compare", help="list the reports whose JSON differs")
    p_compare.add_argument("old", type=Path)
    p_compare.add_argument("new", type=Path)
    args = parser.parse_args(argv)
    if args.command == "save":
        return save(args.dir, args.models)
    return compare(args.old, args.new)


if __name__ == "__main__":
    sys.exit(main())
