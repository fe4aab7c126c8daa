"""``python -m validators.bench``: the estimator's own cost (wall time, peak RSS) at real sizes.

Each case runs in a fresh subprocess so that its peak RSS is its own, with an empty cache of
host-measured CPU kernels (``FXMEM_CACHE_DIR``: the first report on a machine); a case that
measures kernels runs again on the filled cache (every later report).  Figures go to
docs/benchmark.md.  A script, not a timed test: machines differ.
"""

from __future__ import annotations

import argparse
import json
import platform
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

CASES = [
    # (zoo name, size, batch, mode, target device)
    ("resnet", "resnet50", 32, "train", "cpu"),
    ("gpt", "gpt2-small", 8, "train", "cpu"),
    ("gpt", "gpt2-small", 8, "inference", "cpu"),
    ("llama", "7b", 1, "train", "cpu"),
    ("llama", "7b", 1, "inference", "cpu"),
    ("gpt", "gpt2-small", 8, "train", "cuda"),  # + the allocator replay
    ("llama", "7b", 1, "train", "cuda"),
]

_CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
import estimator, models_zoo
name, size, batch, mode, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
model, make_sample, loss_fn = models_zoo.get(name, size, device="meta")
t1 = time.perf_counter()
rep = estimator.report(model, make_sample(batch), batch=batch, mode=mode, optimizer="adamw", loss_fn=loss_fn,
                       device=device, **({"gpu": "H100"} if device == "cuda" else {}))
t2 = time.perf_counter()
measured = sum(int(n.split()[0]) for n in rep.notes if "measured on this host" in n)
print(json.dumps({"import_and_build_s": t1 - t0, "estimate_s": t2 - t1, "peak_bytes": rep.peak_bytes,
                  "formula": str(rep.peak), "capture": rep.path.value, "ops": len(rep.timeline.ops),
                  "measured_calls": measured,
                  "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


# compare over the default strategies (4 devices; nine since the compiled row) against one report, same model, one process
_COMPARE_CHILD = """
import json, sys, time
import estimator, models_zoo
name, size, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
model, make_sample, loss_fn = models_zoo.get(name, size, device="meta")
t0 = time.perf_counter()
estimator.report(model, make_sample(batch), batch=batch, loss_fn=loss_fn, device="cpu")
t1 = time.perf_counter()
result = estimator.compare(model, make_sample(batch), batch, loss_fn=loss_fn, devices=4, device="cpu")
t2 = time.perf_counter()
print(json.dumps({"report_s": t1 - t0, "compare_s": t2 - t1, "strategies": [r.label for r in result.rows]}))
"""
COMPARE_CASE = ("gpt", "gpt2-small", 8)


def run_compare(name: str, size: str, batch: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="fxmem-bench-cache-") as cache:  # the first run on a machine
        out = subprocess.run([sys.executable, "-c", _COMPARE_CHILD, name, size, str(batch)], capture_output=True,
                             text=True, check=True, env={**os.environ, "FXMEM_CACHE_DIR": cache})
    return json.loads(out.stdout.strip().splitlines()[-1]) | {"model": name, "size": size, "batch": batch}


def run_case(name: str, size: str, batch: int, mode: str, device: str, cache: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, name, size, str(batch), mode, device], capture_output=True, text=True,
        check=True, env={**os.environ, "FXMEM_CACHE_DIR": cache},
    )
    case = {"model": name, "size": size, "batch": batch, "mode": mode, "device": device}
    return json.loads(out.stdout.strip().splitlines()[-1]) | case


def run_cold_and_warm(*case) -> dict:
    """The case on an empty kernel cache, and again on the cache it filled when it measured any."""
    with tempfile.TemporaryDirectory(prefix="fxmem-bench-cache-") as cache:
        result = run_case(*case, cache)
        if result["measured_calls"]:
            result["warm_estimate_s"] = run_case(*case, cache)["estimate_s"]
    return result


def to_markdown(results: list[dict], compare: dict | None = None) -> str:
    lines = [
        "# Estimator cost",
        "",
        (f"`python -m validators.bench` on {platform.processor() or platform.machine()}, "
         f"{torch.get_num_threads()} threads, torch {torch.__version__}; models built on the meta device, "
         "optimizer AdamW; each case in a fresh process (peak RSS includes importing torch). Device `cuda`: "
         "the CUDA target for an H100 (CUDA kernels and defaults, allocator replay), still on this CPU machine. "
         "Estimate time: with an empty cache of host-measured CPU kernels (the first report on a machine) "
         "and, where kernels were measured, with the filled cache (every later report)."),
        "",
        ("| model | size | mode | device | batch | estimate time | cached kernels | kernels measured | import + build "
         "| peak RSS | ops | capture | predicted peak |"),
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in results:
        warm = f"{r['warm_estimate_s']:.1f} s" if "warm_estimate_s" in r else "-"
        lines.append(
            f"| {r['model']} | {r['size']} | {r['mode']} | {r['device']} | {r['batch']} | {r['estimate_s']:.1f} s "
            f"| {warm} | {r['measured_calls']} | {r['import_and_build_s']:.1f} s | {r['max_rss_bytes'] / 2**30:.2f} GiB "
            f"| {r['ops']} | {r['capture']} | {r['peak_bytes'] / 2**30:.2f} GiB |"
        )
    if compare is not None:
        ratio = compare["compare_s"] / compare["report_s"]
        lines += [
            "",
            "## compare",
            "",
            (f"`estimator.compare` of {compare['model']} {compare['size']} (b = {compare['batch']}, train, CPU) over "
             f"{len(compare['strategies'])} strategies ({', '.join(compare['strategies'])}): "
             f"{compare['compare_s']:.1f} s against {compare['report_s']:.1f} s for one `report` in the same process: "
             f"**{ratio:.2f}x** (target: <= 3x). The strategies share captures: DDP, ZeRO and the pipeline "
             "transform the one captured step; bf16 autocast and checkpointing are captures of their own."),
        ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validators.bench", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmark.md"))
    parser.add_argument("--compare-only", action="store_true", help="run the compare case only (prints it)")
    args = parser.parse_args(argv)
    compare = run_compare(*COMPARE_CASE)
    print(json.dumps(compare), flush=True)
    if args.compare_only:
        return 0
    results = []
    for case in CASES:
        result = run_cold_and_warm(*case)
        print(json.dumps(result), flush=True)
        results.append(result)
    args.out.write_text(to_markdown(results, compare))
    return 0


if __name__ == "__main__":
    sys.exit(main())
