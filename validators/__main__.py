"""``python -m validators``: validate the CPU predictions over the zoo and write docs/validation.md."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from validators import compiled, generate, low_bit, steps, strategies, zoo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validators", description=__doc__)
    parser.add_argument("--models", nargs="*", help="zoo names (default: all)")
    parser.add_argument("--batches", nargs="*", type=int, default=list(zoo.BATCHES))
    parser.add_argument("--modes", nargs="*", default=list(zoo.MODES), choices=zoo.MODES)
    parser.add_argument("--markdown", type=Path, default=Path("docs/validation.md"))
    parser.add_argument("--json", type=Path, default=Path("docs/validation.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for row in zoo.run(args.models, args.modes, args.batches):
        print(f"{row.model:10s} {row.size:14s} {row.dtype} {row.mode:9s} b={row.batch:<3d} predicted {row.predicted:>12,} "
              f"measured {row.measured:>12,} error {row.error:+.3f} % ({row.capture})", flush=True)
        rows.append(row)
    command = "python -m validators" + ("" if argv is None and len(sys.argv) == 1 else " " + " ".join(sys.argv[1:] if argv is None else argv))
    # the sections python -m validators.strategies, .steps, .generate and .compiled write
    kept = [section for section in (strategies.kept_section(args.markdown), steps.kept(args.markdown),
                                    generate.kept(args.markdown), compiled.kept(args.markdown),
                                    low_bit.kept(args.markdown)) if section]
    args.markdown.write_text(zoo.to_markdown(rows, command) + "".join("\n" + section for section in kept))
    args.json.write_text(json.dumps(zoo.to_json(rows), indent=1) + "\n")
    stats = zoo.summary(rows)
    print(f"median |error| {stats['median_abs_error_pct']:.3f} %, max {stats['max_abs_error_pct']:.3f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
