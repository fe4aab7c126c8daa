"""``python -m validators.unchanged``: prove a refactor changed no number.

``save DIR`` writes the report JSON of every zoo model (debug size) × {train, inference} × {CPU, CUDA
target} at two batch sizes into DIR, one file per report (``gpt-train-cuda-b8.json``), the checkout's
own path written ``<repo>``; a report that is refused is saved as its error message.  ``compare OLD
NEW`` counts the reports whose JSON is byte-identical, and of the others whether anything but the
notes' wording differs (a note may name a module that moved); it prints each changed note once and
exits 1 when a number, a formula or a refusal differs.  Run ``save`` on the old tree and the new one (a ``git
worktree`` of the old commit works), then ``compare``.  Only the public API is used, so the script
runs unchanged on both sides of a move.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path

BATCHES = (2, 8)
REPO = Path(__file__).resolve().parent.parent
MODES = ("train", "inference")
DEVICES = ("cpu", "cuda")


def save(out: Path, names: list[str] | None) -> int:
    import torch

    import estimator
    import models_zoo

    out.mkdir(parents=True, exist_ok=True)
    for name in names or models_zoo.names():
        for mode in MODES:
            for device in DEVICES:
                for b in BATCHES:
                    torch.manual_seed(0)  # the same weights on both sides: the sample's MoE routing follows them
                    model, make_sample, loss_fn = models_zoo.get(name, "debug")
                    if mode == "inference":
                        model.eval()
                    try:
                        text = estimator.report(model, make_sample(b), mode=mode, loss_fn=loss_fn,
                                                device=device).to_json()
                    except estimator.FxmemError as err:
                        text = f"{type(err).__name__}: {err}"
                    path = out / f"{name}-{mode}-{device}-b{b}.json"
                    path.write_text(text.replace(str(REPO), "<repo>") + "\n")
                    print(path.name, flush=True)
    return 0


def _without_notes(text: str):
    """The report with every ``notes`` list (its own and its ranks') dropped; None for a refusal."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None

    def strip(v):
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if k != "notes"}
        return [strip(x) for x in v] if isinstance(v, list) else v

    return strip(value)


def _notes(text: str) -> set[str]:
    found = set()

    def walk(v):
        if isinstance(v, dict):
            found.update(v.get("notes", ()))
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    walk(json.loads(text))
    return found


def _changed_words(before: str, after: str, context: int = 3) -> list[str]:
    """Each place two notes differ, as ``…words [old -> new] words…``."""
    a, b = before.split(" "), after.split(" ")
    return [f"…{' '.join(a[max(i1 - context, 0):i1])} [{' '.join(a[i1:i2])} -> {' '.join(b[j1:j2])}] "
            f"{' '.join(a[i2:i2 + context])}…"
            for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
            if tag != "equal"]


def compare(old: Path, new: Path) -> int:
    names = sorted({p.name for p in old.glob("*.json")} | {p.name for p in new.glob("*.json")})
    missing = [n for n in names if not (old / n).exists() or not (new / n).exists()]
    pairs = {n: ((old / n).read_text(), (new / n).read_text()) for n in names if n not in missing}
    identical = [n for n, (a, b) in pairs.items() if a == b]
    notes_only = [n for n, (a, b) in pairs.items()
                  if a != b and (stripped := _without_notes(a)) is not None and stripped == _without_notes(b)]
    numbers = sorted(set(pairs) - set(identical) - set(notes_only))
    changed: dict[str, set[str]] = {}  # where a note's wording changed -> the reports
    for n in notes_only:
        a, b = (sorted(_notes(text)) for text in pairs[n])
        for before, after in zip(sorted(set(a) - set(b)), sorted(set(b) - set(a))):
            for words in _changed_words(before, after):
                changed.setdefault(words, set()).add(n)
    for words, reports in sorted(changed.items()):
        print(f"{len(reports):3d} report(s), a note: {words}")
    for n in missing + numbers:
        print("differs:", n)
    print(f"{len(identical)} of {len(names)} reports byte-identical; {len(notes_only)} differ in a note's wording "
          f"only; {len(numbers) + len(missing)} differ in a number, a formula or a refusal")
    return 1 if numbers or missing else 0


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
