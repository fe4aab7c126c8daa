"""``python -m validators.strategy_pages``: one page per training strategy in docs/strategies/.

Each page: what the strategy changes in memory (and where in PyTorch that comes from), the
formulas fxmem produces for the zoo's GPT-2-small with it (per device, against one device),
how to ask for it, and its rows of the measured validation matrix
(docs/validation-strategies.json, written by ``python -m validators.strategies``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import estimator
import models_zoo
from estimator import Strategy
from estimator.reporting.render import ranks_text
from estimator.vocab.units import format_bytes

MODEL, SIZE, BATCH = "gpt", "gpt2-small", 8


@dataclass(frozen=True)
class Page:
    slug: str
    title: str
    what: str  # markdown: what changes, and the PyTorch code it follows
    usage: str  # markdown code block
    strategies: dict[str, Strategy]  # label -> strategy shown for GPT-2-small
    matrix: tuple[str, ...]  # validation-matrix case names containing one of these


def _fsdp(**options):
    import functools

    from models_zoo import parallelize

    return functools.partial(parallelize.fsdp, **options) if options else parallelize.fsdp


def _block():
    from models_zoo.gpt import Block

    return Block


def pages() -> list[Page]:
    block = _block()
    return [
        Page(
            "mixed-precision", "Mixed precision (autocast)",
            "`torch.autocast` runs the ops on its lower-precision list in fp16/bf16 and keeps the others "
            "(reductions, norms, losses) in fp32. Memory changes in three places: activations saved for "
            "backward by low-precision ops are half the size; each fp32 weight is cast once per forward and "
            "the copy is kept in autocast's weight-cast cache until the autocast region exits (so it is alive "
            "through the whole forward and is saved for backward); fp16 adds a `GradScaler` (two 4-byte "
            "tensors) and scales the loss. Parameters, gradients and optimizer state stay fp32. The CPU "
            "target follows CPU autocast's op lists natively; the CUDA target emulates CUDA's lists "
            "(`estimator/corrections/cuda/autocast.py`).",
            "```python\nestimator.report(model, sample, amp=\"bf16\")            # or Strategy(amp=\"bf16\")\n"
            "estimator.report(model, sample, amp=\"fp16\")            # + GradScaler\n```\n"
            "`fxmem report gpt --size gpt2-small --amp bf16`",
            {"one device": Strategy(), "AMP bf16": Strategy(amp="bf16"), "AMP fp16 + GradScaler": Strategy(amp="fp16")},
            ("amp",),
        ),
        Page(
            "accumulation", "Gradient accumulation",
            "`accumulate=k` runs the optimizer step's batch `b` as `k` micro-batches of `b/k` "
            "(`loss / k` backward each time). Activations are those of one micro-batch, but the gradients "
            "live from the first micro-batch's backward to the optimizer step, so the second and later "
            "backwards run with the gradients already alive (the peak moves there), and `AccumulateGrad` "
            "adds each new gradient into `.grad` (a temporary the size of the gradient while it adds). "
            "The formula is in the optimizer step's `b` (a multiple of `k`); the capture's symbol is the "
            "micro-batch `b/k`.",
            "```python\nestimator.report(model, sample, batch=32, strategy=estimator.Strategy(accumulate=4))\n```\n"
            "`fxmem report gpt --batch 32 --accumulate 4`",
            {"one device": Strategy(), "accumulate 2": Strategy(accumulate=2), "accumulate 4": Strategy(accumulate=4)},
            ("accumulate",),
        ),
        Page(
            "checkpointing", "Activation checkpointing",
            "The selected modules' forward runs inside `torch.utils.checkpoint.checkpoint`: only their inputs "
            "are saved; in backward their forward runs again (under the recorded autocast and RNG state) just "
            "before its backward, so at most one checkpointed module's activations exist at a time during "
            "backward. Non-reentrant (the default, `use_reentrant=False`) recomputes through saved-tensor "
            "hooks; reentrant re-runs the forward inside the backward of a custom Function and keeps its "
            "inputs detached. With `preserve_rng_state` (default) each checkpointed call keeps a copy of the "
            "CPU RNG state (5,056 B) until its recomputation.",
            "```python\nestimator.report(model, sample, strategy=estimator.Strategy(checkpoint=Block))     # every Block\n"
            "estimator.report(model, sample, strategy=estimator.Strategy(checkpoint=\"transformer.h.*\"))\n```\n"
            "`fxmem report gpt --checkpoint Block`",
            {"one device": Strategy(), "checkpoint Block": Strategy(checkpoint=block),
             "checkpoint Block (reentrant)": Strategy(checkpoint=block, checkpoint_reentrant=True)},
            ("checkpoint",),
        ),
        Page(
            "ddp", "Data parallel (DDP)",
            "Each of the `N` ranks holds a full replica and runs its own `b` samples (global batch `N·b`). "
            "DDP adds its gradient buckets (`torch/csrc/distributed/c10d/reducer.cpp`): flat buffers, one per "
            "bucket, alive from construction, rebuilt after the first iteration in the order gradients became "
            "ready, closed at 1 MiB for the first bucket and at `bucket_cap_mb` (25) after it. Their total is "
            "the gradients' size. Without `gradient_as_bucket_view` each gradient is copied into its bucket "
            "and back (gradients + buckets); with it the gradients are views of the buckets. Module buffers "
            "are broadcast through a flat buffer at each forward. ZeRO-1 "
            "(`ZeroRedundancyOptimizer` over DDP) keeps only its share of the optimizer state: see "
            "[ZeRO](zero.md).",
            "```python\nestimator.report(model, sample, strategy=estimator.Strategy(data_parallel=8))\n"
            "estimator.report(model, sample, strategy=estimator.Strategy(data_parallel=8, gradient_as_bucket_view=True))\n"
            "```\n`fxmem report gpt --dp 8`",
            {"one device": Strategy(), "DDP x8": Strategy(data_parallel=8),
             "DDP x8 gradient_as_bucket_view": Strategy(data_parallel=8, gradient_as_bucket_view=True)},
            ("DDP",),
        ),
        Page(
            "zero", "ZeRO and FSDP (sharding)",
            "Sharding over the `N` data-parallel ranks, as PyTorch implements it. **ZeRO-1**: "
            "`torch.distributed.optim.ZeroRedundancyOptimizer` over DDP; each rank keeps the optimizer state "
            "of the whole parameters assigned to it (largest first, to the rank with the fewest elements) "
            "and updates them, then broadcasts them. **ZeRO-2 / ZeRO-3**: FSDP2 `fully_shard` on each block "
            "and the root, `reshard_after_forward=False` / `True`: parameters live as dim-0 shards padded to "
            "a multiple of `N`, optimizer state follows the unpadded local shard, each unit's parameters are "
            "all-gathered before its forward (and again before its backward with ZeRO-3), gradients are "
            "reduce-scattered into sharded gradients after each unit's backward "
            "(`torch/distributed/fsdp/_fully_shard/`).",
            "```python\nestimator.report(model, sample, strategy=estimator.Strategy(data_parallel=8, sharding=\"zero3\"))\n"
            "```\n`fxmem report gpt --dp 8 --zero 3`",
            {"one device": Strategy(), "ZeRO-1 x8": Strategy(data_parallel=8, sharding="zero1"),
             "ZeRO-2 x8": Strategy(data_parallel=8, sharding="zero2"),
             "ZeRO-3 x8": Strategy(data_parallel=8, sharding="zero3"),
             "ZeRO-3 x8 + checkpoint + AMP bf16": Strategy(data_parallel=8, sharding="zero3", checkpoint=block,
                                                           amp="bf16")},
            ("ZeRO",),
        ),
        Page(
            "pipeline", "Pipeline parallel",
            "The model's blocks are cut into `S` contiguous stages (modules before the first block go to the "
            "first stage, after the last block -- head, loss -- to the last), and the batch `b` into `m` "
            "micro-batches. Each stage holds its own parameters, gradients and optimizer state, and the "
            "activations of the micro-batches in flight: all `m` with GPipe, at most `S - i` on stage `i` "
            "with 1F1B; plus what `torch.distributed.pipelining` keeps (receive buffers, outputs kept for "
            "backward). Default cut: balanced by memory; `split_points` names the blocks where stages 2.. "
            "start. With `data_parallel=D`, `D` pipelines (`S * D` ranks, rank `k * D + d` running stage `k` "
            "of pipeline `d`), each stage's replicas under DDP: a stage adds the buckets of its own "
            "parameters' gradients (every forward runs under `no_sync()`, so no buffer broadcast). FSDP2 of "
            "the stages (torchtitan's PP x FSDP, and with TP its 3-D job) runs as the job writes it: a "
            "parallelize function that cuts the model to the rank's stage and returns its schedule, on a "
            "device mesh (the `mesh:` rows below; the mesh page).",
            "```python\nestimator.report(model, sample, batch=32,\n"
            "                 strategy=estimator.Strategy(pipeline=4, microbatches=8, schedule=\"1f1b\"))\n```\n"
            "`fxmem report gpt --batch 32 --pipeline 4 --microbatches 8`",
            {"one device": Strategy(), "pipeline x4 GPipe, 8 micro-batches": Strategy(pipeline=4, microbatches=8,
                                                                                       schedule="gpipe"),
             "pipeline x4 1F1B, 8 micro-batches": Strategy(pipeline=4, microbatches=8),
             "pipeline x4 1F1B x DDP 2, 8 micro-batches": Strategy(pipeline=4, data_parallel=2, microbatches=8)},
            ("pipeline", "GPipe", "1F1B"),
        ),
        Page(
            "mesh", "Your parallel code on a device mesh (FSDP2, HSDP, tensor and sequence parallelism)",
            "The job's own parallelize function, `fn(model, mesh)`, runs in the capture of each rank as the "
            "job runs it: on a fake process group of the mesh's size (no processes, any size), with a "
            "`DeviceMesh` of the job's dim names (`estimator/capture/world.py`). `fully_shard` (with "
            "`MixedPrecisionPolicy`, `reshard_after_forward` True / False / an int, HSDP on a 2-D mesh), "
            "`parallelize_module` (colwise, rowwise, sequence parallel, `PrepareModuleInput`) and selective "
            "checkpointing policies run as written; each rank's DTensor shards, FSDP2's all-gather and "
            "reduce-scatter buffers and unsharded copies are recorded as they are allocated, and gloo's "
            "buffers around each collective are added on the CPU target. Ranks whose shards have the same "
            "shapes run the same program: one capture each. Blocks the function `torch.compile`s are compiled "
            "regions, each batch size its own static program as in the real loop; torchao's float8 linears "
            "(rowwise, tensorwise with FSDP2's float8 all-gather) run as written (torchtitan's job, "
            "`validators/torchtitan.py`). Expert parallelism that moves tokens between ranks "
            "(transformers' all-to-all dispatch, `functools.partial(estimator.own_plans, ep=2)`) runs as written: "
            "each rank's routing is its routers' on the sample (the probe's real forward, so real weights), and "
            "what an all-to-all of the token counts brings from the other ranks is taken as every rank routing "
            "alike (noted; ranks that receive different tokens are captured one by one). A pipeline runs too: "
            "the function cuts the model in place to the rank's stage, wraps it and returns its "
            "`torch.distributed.pipelining` schedule, whose forwards, backwards, sends and receives run as "
            "written (`estimator/capture/pipelines.py`; the stages' shapes given or inferred, torchtitan's "
            "PP x FSDP2 and PP x FSDP2 x TP jobs). Example functions: `models_zoo/parallelize.py`.",
            "```python\nfrom models_zoo import parallelize\n"
            "estimator.report(model, sample, strategy=estimator.Strategy(mesh={\"dp_shard\": 8},\n"
            "                                                            parallelize=parallelize.fsdp))\n```\n"
            "`fxmem report gpt --mesh dp_shard=8 --parallelize models_zoo.parallelize:fsdp`",
            {"one device": Strategy(), "FSDP2 x8 (run as written)": Strategy(mesh={"dp_shard": 8},
                                                                             parallelize=_fsdp()),
             "HSDP 2 x 4": Strategy(mesh={"dp_replicate": 2, "dp_shard": 4}, parallelize=_fsdp()),
             "FSDP2 x8, reshard_after_forward=False": Strategy(mesh={"dp_shard": 8},
                                                                parallelize=_fsdp(reshard_after_forward=False))},
            ("mesh:",),
        ),
    ]


def render(page: Page, matrix: list[dict]) -> str:
    model, make_sample, loss_fn = models_zoo.get(MODEL, SIZE, device="meta")
    result = estimator.compare(model, make_sample(BATCH), BATCH, page.strategies, loss_fn=loss_fn,
                               devices=max(s.devices for s in page.strategies.values()), device="cpu")
    lines = [f"# {page.title}", "", page.what, "", "## Asking fxmem", "", page.usage, "",
             f"## GPT-2-small (zoo `{MODEL}` `{SIZE}`), b = {BATCH}, AdamW, CPU target", "",
             "| strategy | device | ranks | peak at b | vs one device | peak formula (bytes, b per device) |",
             "|---|---|---|---:|---:|---|"]
    for row in result.rows:
        ranks = row.report.ranks or ()
        groups = [(r.role, r.ranks, r.report) for r in ranks] or [("one device", (0,), row.report)]
        for role, members, rep in groups:
            saving = "" if row.label == result.baseline else f"{100 * (rep.peak_bytes / result.rows[0].peak_bytes - 1):+.1f} %"
            lines.append(f"| {row.label} | {role} | {ranks_text(members)} | {format_bytes(rep.peak_bytes)} | {saving} | `{rep.peak}` |")
    rows = [r for r in matrix if any(key.lower() in r["case"].lower() for key in page.matrix)]
    lines += ["", "## Measured", ""]
    if rows:
        lines += [("Predicted against measured per rank (`python -m validators.strategies`, "
                  "[all cases](../validation.md)):"), "",
                  "| case | model | rank | role | b | predicted (B) | measured (B) | error |",
                  "|---|---|---:|---|---:|---:|---:|---:|"]
        lines += [f"| {r['case']} | {r['model']} | {r['rank']} | {r['role']} | {r['batch']} | {r['predicted']:,} "
                  f"| {r['measured']:,} | {r['error_pct']:+.3f} % |" for r in rows]
    else:
        lines.append("Not in the validation matrix yet.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validators.strategy_pages", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/strategies"))
    parser.add_argument("--matrix", type=Path, default=Path("docs/validation-strategies.json"))
    args = parser.parse_args(argv)
    matrix = json.loads(args.matrix.read_text())["rows"] if args.matrix.exists() else []
    args.out.mkdir(parents=True, exist_ok=True)
    index = ["# Training strategies", "", ("What each strategy does to the memory of one training step, per "
             "device; the formulas fxmem gives for GPT-2-small; the measured comparison."), ""]
    for page in pages():
        (args.out / f"{page.slug}.md").write_text(render(page, matrix))
        index.append(f"- [{page.title}]({page.slug}.md)")
        print(f"wrote {args.out / page.slug}.md", flush=True)
    (args.out / "README.md").write_text("\n".join(index) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
