"""``python -m validators.bench``: the estimator's own cost (wall time, peak RSS) at real sizes.

Each case runs in a fresh subprocess so that its peak RSS is its own, with an empty cache of
host-measured CPU kernels (``FXMEM_CACHE_DIR``: the first report on a machine); a case that
measures kernels runs again on the filled cache (every later report).  Beside them, in one
process per model (``SPEED_CASES``): the same training step as a bare step on fake tensors
(nothing tracked: the floor of any fake-execution estimator), the same with the batch size a
symbol (the floor of a symbolic one), PyTorch's ``MemTracker`` inside ``FakeTensorMode`` (one
batch size) and ``estimator.report`` (every batch size), as ratios to the bare step; the cold
start of ``fxmem report mlp --batch 8``; and ``compare`` against one report.  Figures go to
docs/benchmark.md.  A script, not a timed test: machines differ.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._pytree import tree_map_only

from validators.strategies import write_section

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


# compare over the default strategies (4 devices) against one report, same model, one process: with its
# captures in worker processes (the default), then again with every capture here (workers=1, each timed)
_COMPARE_CHILD = """
import json, sys, time
import estimator, models_zoo
from estimator import planning
from estimator.orchestrate import estimate, path, workers
name, size, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
model, make_sample, loss_fn = models_zoo.get(name, size, device="meta")
transforms = []  # the QLoRA what-if's model transforms (the first imports PEFT), timed
qlora = planning.qlora
def timed_qlora(m):
    t = time.perf_counter()
    out = qlora(m)
    transforms.append(time.perf_counter() - t)
    return out
planning.qlora = timed_qlora
def compare(**kw):
    weights = {planning.QLORA: timed_qlora} if planning.default_weights(model)[0] else {}
    return estimator.compare(model, make_sample(batch), batch, loss_fn=loss_fn, devices=4, device="cpu",
                             weights=weights, **kw)
t0 = time.perf_counter()
estimator.report(model, make_sample(batch), batch=batch, loss_fn=loss_fn, device="cpu")
t1 = time.perf_counter()
result = compare()
t2 = time.perf_counter()
estimator.forget_captures()
estimator.report(model, make_sample(batch), batch=batch, loss_fn=loss_fn, device="cpu")
captures, current = {}, {}
capture_formula, formula = estimate.capture_formula, path.formula
def labelled(checked, *rest):  # the request whose step may be captured
    optimizer = None if checked.optimizer_name == "adamw" else checked.optimizer_name
    current["label"] = (checked.strategy.describe() + (f", {optimizer}" if optimizer else "")
                        + (f", {type(checked.model).__name__}" if checked.model is not model else ""))
    return capture_formula(checked, *rest)
def timed(*args):  # a capture
    t = time.perf_counter()
    out = formula(*args)
    captures[current["label"]] = time.perf_counter() - t
    return out
estimate.capture_formula, path.formula = labelled, timed
t3 = time.perf_counter()
compare(workers=1)
t4 = time.perf_counter()
print(json.dumps({"report_s": t1 - t0, "compare_s": t2 - t1, "serial_s": t4 - t3, "workers": workers.usable_cores(),
                  "qlora_transform_s": transforms,
                  "strategies": [r.label for r in result.rows], "captures_s": captures}))
"""
COMPARE_CASE = ("gpt", "gpt2-small", 8)


def _child(args: list[str], cache: str) -> dict:
    """The JSON a fresh Python process (``python *args``) prints last, run on the kernel cache ``cache``."""
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, check=True,
                         env={**os.environ, "FXMEM_CACHE_DIR": cache})
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_compare(name: str, size: str, batch: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="fxmem-bench-cache-") as cache:  # the first run on a machine
        return _child(["-c", _COMPARE_CHILD, name, size, str(batch)], cache) | {"model": name, "size": size,
                                                                                 "batch": batch}


def run_case(name: str, size: str, batch: int, mode: str, device: str, cache: str) -> dict:
    case = {"model": name, "size": size, "batch": batch, "mode": mode, "device": device}
    return _child(["-c", _CHILD, name, size, str(batch), mode, device], cache) | case


def run_cold_and_warm(*case) -> dict:
    """The case on an empty kernel cache, and again on the cache it filled when it measured any."""
    with tempfile.TemporaryDirectory(prefix="fxmem-bench-cache-") as cache:
        result = run_case(*case, cache)
        if result["measured_calls"]:
            result["warm_estimate_s"] = run_case(*case, cache)["estimate_s"]
    return result


# ----------------------------------------------------------------------------------------
# against the bare fake step (one process per model: ``python -m validators.bench --speed NAME``)


def _hf_gpt2(device: str):
    """transformers' ``GPT2LMHeadModel`` (GPT-2 small, 124M, from its default config), 1024 tokens,
    its own loss (``labels``)."""
    from estimator.compat import ensure_torchvision_importable

    ensure_torchvision_importable()
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config()
    with torch.device(device):
        model = GPT2LMHeadModel(config)

    def make_sample(batch: int) -> dict:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (batch, config.n_positions), generator=generator)
        return {"input_ids": ids, "labels": ids}

    return model, make_sample, lambda out, sample: out.loss


def _zoo(name: str, size: str):
    def build(device: str):
        import models_zoo

        return models_zoo.get(name, size, device=device)

    return build


# name -> (builder(device) -> (model, make_sample, loss_fn), batch): a train step with AdamW.  Llama at b = 2:
# at b = 1 torch never makes a dim of size 1 a symbol, so the bare "symbolic" step would be static and the
# report would capture twice (its formula holds from b = 2; b = 1 is captured at its own size).
SPEED_CASES = {
    "hf-gpt2": (_hf_gpt2, 8),
    "llama-7b": (_zoo("llama", "7b"), 2),
    "resnet50": (_zoo("resnet", "resnet50"), 32),
}
SPEED_REPEATS = 3  # timed runs after one untimed (the median is reported)


def _median_time(fn, repeats: int = SPEED_REPEATS) -> tuple[float, object]:
    fn()  # warm: AdamW's state, the fake-kernel caches, the host-kernel cache
    times, result = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), result


def _fake_step(build, batch: int, symbolic: bool, memtracker: bool = False):
    """A function running one train step (forward, loss, backward, AdamW step, zero_grad) of the
    model on fake tensors -- with the sample's batch dim a symbol when ``symbolic``, inside
    PyTorch's ``MemTracker`` (returning its peak) when ``memtracker``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv() if symbolic else None, static_shapes=not symbolic)
    with mode:
        model, make_sample, loss_fn = build("cpu")
        optimizer = torch.optim.AdamW(model.parameters())

    def fake(t: torch.Tensor) -> torch.Tensor:
        if not symbolic or t.dim() == 0 or t.shape[0] != batch:
            return mode.from_tensor(t)
        dims = [DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (t.dim() - 1)
        return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))

    sample = tree_map_only(torch.Tensor, fake, make_sample(batch))

    def step() -> int | None:
        tracker = None
        if memtracker:
            from torch.distributed._tools.mem_tracker import MemTracker

            tracker = MemTracker()
            tracker.track_external(model, optimizer)
        with mode, tracker or contextlib.nullcontext():
            out = model(**sample) if isinstance(sample, dict) else model(*sample) if isinstance(sample, tuple) \
                else model(sample)
            loss_fn(out, sample).backward()
            optimizer.step()
            optimizer.zero_grad()
        return None if tracker is None else tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    step.shape_env = mode.shape_env
    return step


def _specialized(shape_env) -> bool:
    """Whether the model's code fixed the batch symbol to its value (a guard ``Eq(s0, 8)``): the
    rest of that step ran on static shapes, so its time is no floor for a symbolic capture."""
    return any(value.is_number for value in shape_env.replacements.values())


def speed_case(name: str) -> dict:
    """The bare fake step (static and symbolic), MemTracker in fake mode and ``report`` of one
    ``SPEED_CASES`` model, each the median of ``SPEED_REPEATS`` warm runs in this process."""
    import estimator

    build, batch = SPEED_CASES[name]
    bare_s, _ = _median_time(_fake_step(build, batch, symbolic=False))
    # each symbolic run in a new ShapeEnv, as each capture is: the fake-tensor cache of symbolic
    # shapes lives in the ShapeEnv (torch/_subclasses/fake_tensor.py ``_cached_dispatch_impl``)
    fresh = [_fake_step(build, batch, symbolic=True) for _ in range(SPEED_REPEATS + 1)]
    shape_env = fresh[0].shape_env
    symbolic_s, _ = _median_time(lambda: fresh.pop()())  # each dropped once run (not left to the GC's walk)
    memtracker_s, memtracker_peak = _median_time(_fake_step(build, batch, symbolic=False, memtracker=True))
    model, make_sample, loss_fn = build("meta")
    sample = make_sample(batch)
    def report():
        estimator.forget_captures()  # each run captures (none kept from the last)
        return estimator.report(model, sample, batch=batch, optimizer="adamw", loss_fn=loss_fn, device="cpu")

    report_s, rep = _median_time(report)
    return {"case": name, "batch": batch, "bare_s": bare_s, "symbolic_s": symbolic_s,
            "symbolic_specialized": _specialized(shape_env), "memtracker_s": memtracker_s,
            "memtracker_peak": memtracker_peak, "report_s": report_s, "report_peak": rep.peak_bytes,
            "capture": rep.path.value, "formula": str(rep.peak), "ops": len(rep.timeline.ops)}


def run_speed(name: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="fxmem-bench-cache-") as cache:  # the warm run fills it
        return _child(["-m", "validators.bench", "--speed", name], cache)


def _timed(fn, *args):
    """``fn(*args)`` and its time, every step captured afresh (none kept from an earlier run)."""
    import estimator

    estimator.forget_captures()
    t = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - t, result


def _alternating(report, keys: tuple, repeats: int) -> dict:
    """``report(k)`` for each key, warm (one run each first: the fake-kernel caches), then
    ``repeats`` times alternating, so that a slower spell of the machine hits all: per key, the
    median time and the last report."""
    for k in keys:
        report(k)
    runs: dict = {k: [] for k in keys}
    for _ in range(repeats):
        for k in keys:
            runs[k].append(_timed(report, k))
    return {k: (statistics.median(t for t, _ in r), r[-1][1]) for k, r in runs.items()}


@contextlib.contextmanager
def _replaced(owner, name: str, value):
    """``owner.name`` set to ``value`` for the block (a path switched off, to time it without)."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


GENERATE_TOKENS = (8, 256)  # new tokens: a report of each, the same model and prompt
GENERATE_REPEATS = 5  # timed runs of each, alternating (the median is reported)
GENERATE_MARKS = ("<!-- generate-length -->", "<!-- /generate-length -->")


def generate_case() -> dict:
    """``report(mode="generate")`` of the generation validator's tiny Llama (prompt 16, b = 2, the
    CUDA target) at ``GENERATE_TOKENS`` new tokens, each the median of ``GENERATE_REPEATS`` warm
    runs in this process, alternating; the longest once with every decode step captured (as
    before the extension, ``capture/decode_steps.py``); and Llama-3-8B's config (``_llama3_8b``)."""
    import estimator
    from estimator.capture import decode_steps
    from validators import generate as gen

    model, sample = gen.make_model("llama"), gen.make_sample(2, 16)

    def report(n: int):
        return estimator.report(model, sample, mode="generate", new_tokens=n, device="cuda")

    found = _alternating(report, GENERATE_TOKENS, GENERATE_REPEATS)
    with _replaced(decode_steps, "shortened", lambda spec: None):
        full_s, full = _timed(report, GENERATE_TOKENS[-1])
    longest = found[GENERATE_TOKENS[-1]][1]
    assert longest.timeline.storages == full.timeline.storages and longest.cuda == full.cuda  # the same capture
    return {"tokens": {n: {"report_s": t, "ops": len(r.timeline.ops), "peak": r.peak_bytes}
                       for n, (t, r) in found.items()}, "every_step_s": full_s, "llama3_8b": _llama3_8b()}


def _meta_llama(hidden: int, intermediate: int, layers: int, heads: int) -> torch.nn.Module:
    """A Llama-3 config (8 key-value heads, 128,256 tokens, 8,192 positions) on the meta device, bf16."""
    from estimator.integrations._common import import_optional

    transformers = import_optional("transformers", "the benchmark")
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=8, vocab_size=128256,
                                      max_position_embeddings=8192)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


LLAMA3_TOKENS = (16, 512)


def _llama3_8b() -> dict:
    """``generate`` of Llama-3-8B's config on the meta device (bf16, 8 prompts of 512 tokens, the
    CUDA target) at ``LLAMA3_TOKENS`` new tokens: one run each, each in a fresh process, as a user
    runs it (the data-dependent values from a narrow stand-in's real run)."""
    with tempfile.TemporaryDirectory(prefix="fxmem-bench-cache-") as cache:
        return {n: _child(["-m", "validators.bench", "--llama3-8b-child", str(n)], cache) for n in LLAMA3_TOKENS}


def _llama3_8b_child(new_tokens: int) -> dict:
    """``_llama3_8b``'s report at ``new_tokens``, in this process."""
    import estimator

    model = _meta_llama(hidden=4096, intermediate=14336, layers=32, heads=32)
    ids = torch.randint(0, model.config.vocab_size, (8, 512), generator=torch.Generator().manual_seed(0))
    t = time.perf_counter()
    rep = estimator.report(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, mode="generate",
                           new_tokens=new_tokens)
    return {"report_s": time.perf_counter() - t, "ops": len(rep.timeline.ops), "peak": rep.peak_bytes}


def generate_markdown(found: dict) -> str:
    from estimator.capture.decode_steps import CALLS

    (short, a), (long, b) = ((n, found["tokens"][n]) for n in GENERATE_TOKENS)
    ratio = b["report_s"] / a["report_s"]
    return "\n".join([
        GENERATE_MARKS[0],
        "## Generated length",
        "",
        f"`report(mode=\"generate\")` of a tiny Llama (2 layers, prompt 16, b = 2, the CUDA target; "
        f"`python -m validators.bench --generate`), the median of {GENERATE_REPEATS} warm runs of each, alternating: "
        f"{short} new tokens "
        f"{a['report_s']:.2f} s ({a['ops']:,} ops), {long} new tokens {b['report_s']:.2f} s ({b['ops']:,} ops): "
        f"**{ratio:.2f}x** (target: <= 1.5x). The decode steps are captured for {CALLS} calls of the "
        "model and extended to every one (`estimator/capture/decode_steps.py`); the rest grows with the ops "
        f"(accounting and the allocator replay). With every step captured, {long} new tokens took "
        f"{found['every_step_s']:.1f} s here (one run), the same timeline. Llama-3-8B's config on the meta device "
        "(bf16, 8 prompts of 512 tokens, one run each in a fresh process): "
        + ", ".join(f"{n} new tokens {r['report_s']:.1f} s ({r['ops']:,} ops)" for n, r in found["llama3_8b"].items())
        + " (target for 512: <= 15 s). Its 6 calls of the model run 5 of the 32 layers (the repeated blocks, "
        "`estimator/capture/repeated_blocks.py`), extended to 32 before the decode steps are built; what is left "
        "grows with the built run's ops: the decode steps' extension, the accounting and the allocator replay (three "
        "walks of the run's allocations, in a process forked from the raw capture while it is accounted and the report "
        "assembled, the last two side by side: the benchmark protocol's second step in a process of its own, "
        "`estimator/vocab/forked.py`) take each op of every built step. The replay cannot take a built step at "
        "once: the allocator's free blocks never fall into the same arrangement twice over the decode steps "
        "(measured: no two calls take the same branches), so its state is no line in the step "
        "(docs/design.md, \"Where a long generate()'s time goes\").",
        GENERATE_MARKS[1],
    ])


DEPTHS = (8, 80)  # blocks: a report of each, the same tiny Llama otherwise
DEPTH_REPEATS = 5  # timed runs of each, alternating (the median is reported)
DEPTH_MARKS = ("<!-- depth -->", "<!-- /depth -->")


def depth_case() -> dict:
    """The train ``report`` of a tiny Llama config (hidden 64, b = 2, 16 tokens, the CUDA target)
    at ``DEPTHS`` blocks, each the median of ``DEPTH_REPEATS`` warm runs in this process,
    alternating; the deepest once with every block captured (as before the extension,
    ``capture/repeated_blocks.py``); and Llama-3-70B's config on the meta device (``_llama_70b``)."""
    import estimator
    from estimator.capture import repeated_blocks
    from estimator.integrations._common import import_optional

    transformers = import_optional("transformers", "the depth benchmark")

    def model(blocks: int):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=blocks, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256))

    models = {n: model(n) for n in DEPTHS}
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    def report(n: int):
        return estimator.report(models[n], {"input_ids": ids, "labels": ids}, device="cuda")

    found = _alternating(report, DEPTHS, DEPTH_REPEATS)
    with _replaced(repeated_blocks, "plan", lambda model, spec: None):
        full_s, full = _timed(report, DEPTHS[-1])
    deepest = found[DEPTHS[-1]][1]
    assert deepest.timeline.storages == full.timeline.storages and deepest.cuda == full.cuda  # the same capture
    return {"blocks": {n: {"report_s": t, "ops": len(r.timeline.ops), "peak": r.peak_bytes}
                       for n, (t, r) in found.items()}, "every_block_s": full_s, "llama_70b": _llama_70b()}


def _llama_70b() -> dict:
    """The train ``report`` of Llama-3-70B's config on the meta device (bf16, AdamW, one sequence
    of 4,096 tokens, the CUDA target): one run."""
    import estimator

    model = _meta_llama(hidden=8192, intermediate=28672, layers=80, heads=64)
    ids = torch.randint(0, model.config.vocab_size, (1, 4096), generator=torch.Generator().manual_seed(0))
    t = time.perf_counter()
    rep = estimator.report(model, {"input_ids": ids, "labels": ids})
    t1 = time.perf_counter()
    depth = estimator.report(model, {"input_ids": ids, "labels": ids}, depth_symbols=True).depth_formula  # reuses it
    return {"report_s": t1 - t, "ops": len(rep.timeline.ops), "peak": rep.peak_bytes,
            "depth_s": time.perf_counter() - t1, "depth_checked": "checked one unit deeper" in " ".join(depth.notes)}


def depth_markdown(found: dict) -> str:
    (shallow, a), (deep, b) = ((n, found["blocks"][n]) for n in DEPTHS)
    big = found["llama_70b"]
    return "\n".join([
        DEPTH_MARKS[0],
        "## Depth",
        "",
        f"The train `report` of a tiny Llama config (hidden 64, b = 2, 16 tokens, the CUDA target; "
        f"`python -m validators.bench --depth`), the median of {DEPTH_REPEATS} warm runs of each, alternating: "
        f"{shallow} blocks {a['report_s']:.2f} s ({a['ops']:,} ops), {deep} blocks {b['report_s']:.2f} s "
        f"({b['ops']:,} ops): **{b['report_s'] / a['report_s']:.2f}x** (target: <= 1.5x). Both capture 5 blocks "
        "(the first three and the last two) and build the others from them (`estimator/capture/repeated_blocks.py`); "
        f"the rest grows with the ops (accounting and the allocator replay). With every block captured, {deep} "
        f"blocks took {found['every_block_s']:.1f} s here (one run), the same timeline. Llama-3-70B's config on the "
        f"meta device (bf16, AdamW, one sequence of 4,096 tokens, one run): {big['report_s']:.1f} s "
        f"({big['ops']:,} ops; target: <= 10 s), peak {big['peak'] / 2**30:.1f} GiB. The same report with "
        f"`depth_symbols=True` (the peak in b and the number of blocks L, `orchestrate/depth_formula.py`), its capture "
        f"reused: {big['depth_s']:.1f} s more, for the step built at 81 blocks and the model with 81 blocks captured "
        "to check it against " + ("(they agree)." if big["depth_checked"] else "(not checked: see its notes)."),
        DEPTH_MARKS[1],
    ])


COLD_COMMAND = ["report", "mlp", "--batch", "8"]
COLD_REPEATS = 5


def run_cold() -> dict:
    """Wall time of ``fxmem report mlp --batch 8`` from a cold start (a new interpreter), each of
    ``COLD_REPEATS`` runs."""
    times = []
    for _ in range(COLD_REPEATS):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "estimator", *COLD_COMMAND], capture_output=True, check=True)
        times.append(time.perf_counter() - t)
    return {"command": "fxmem " + " ".join(COLD_COMMAND), "times_s": times}


def to_markdown(results: list[dict], speed: list[dict] = (),
                cold: dict | None = None) -> str:
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
    if speed:
        lines += [
            "",
            "## Against a bare fake step",
            "",
            ("One train step (forward, loss, backward, AdamW step) per model, each figure the median of "
             f"{SPEED_REPEATS} warm runs in one process (`python -m validators.bench --speed NAME`): the bare step on "
             "fake tensors with nothing tracked (static shapes: the floor of any fake-execution estimator), the "
             "same with the batch dim a symbol (the floor of a symbolic one: each run in a new `ShapeEnv` with "
             "a new fake model, its first step, as each capture starts: the fake-tensor cache of symbolic shapes "
             "lives in the `ShapeEnv`), PyTorch's `MemTracker` "
             "inside `FakeTensorMode` (one batch size) and `estimator.report` (every batch size; CPU target, "
             "host kernels cached), as ratios to the bare step. HF GPT-2 is transformers' `GPT2LMHeadModel` "
             "(124M, 1024 tokens, its own loss). *specialized*: the batch symbol became a constant during that "
             "step (a guard `Eq(s0, 8)`; for GPT-2 at the `F.pad` of its loss, docs/design.md) and the rest ran "
             "on static shapes, so it is no floor for a symbolic capture; the report's capture path is in "
             "brackets. The peaks differ where the CPU target adds the kernels' own buffers measured on this "
             "host (ResNet-50's convolutions)."),
            "",
            ("| model | batch | bare step | symbolic bare step | MemTracker in fake mode | report | report / bare "
             "| report / symbolic | MemTracker peak | report peak |"),
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in speed:
            bare = r["bare_s"]
            specialized = ", specialized" if r["symbolic_specialized"] else ""
            lines.append(
                f"| {r['case']} | {r['batch']} | {bare:.2f} s | {r['symbolic_s']:.2f} s "
                f"({r['symbolic_s'] / bare:.1f}x{specialized}) "
                f"| {r['memtracker_s']:.2f} s ({r['memtracker_s'] / bare:.1f}x) "
                f"| {r['report_s']:.2f} s ({r['capture']}) | **{r['report_s'] / bare:.1f}x** "
                f"| {r['report_s'] / r['symbolic_s']:.1f}x | {r['memtracker_peak']:,} B | {r['report_peak']:,} B |"
            )
    if cold is not None:
        times = cold["times_s"]
        lines += [
            "",
            "## Cold start",
            "",
            (f"`{cold['command']}` in a new interpreter ({len(times)} runs): "
             f"median **{statistics.median(times):.2f} s** "
             f"(min {min(times):.2f} s, max {max(times):.2f} s; target: <= 3 s). Importing torch and Dynamo "
             "(`FakeTensorMode` imports `torch._dynamo.config`) is most of it."),
        ]
    return "\n".join(lines) + "\n"


RANKS_MARKS = ("<!-- ranks -->", "<!-- /ranks -->")
RANKS = (8, 128, 1024)


def ranks_case() -> dict:
    """torchtitan's Llama 3.1 8B job (``validators.torchtitan``: its parallelize function with
    op-level SAC and FSDP2, its step and AdamW, 2 sequences of 8,192 tokens per rank, the CUDA
    target) on fake process groups of ``RANKS`` ranks: one report each, in this process."""
    import estimator
    from estimator import Strategy
    from validators import torchtitan

    found = {}
    for ranks in RANKS:
        t = time.perf_counter()
        rep = estimator.report(torchtitan.build(), torchtitan.sample(2), batch=2, step=torchtitan.train_step,
                               optimizer=torchtitan.optimizer, alloc_conf="expandable_segments:True", device="cuda",
                               strategy=Strategy(mesh={"dp_shard": ranks}, parallelize=torchtitan.parallelize))
        found[ranks] = {"report_s": time.perf_counter() - t, "roles": [r.role for r in rep.ranks]}
    return found


def ranks_markdown(found: dict) -> str:
    one = found[RANKS[0]]
    return "\n".join([
        RANKS_MARKS[0],
        "## Ranks",
        "",
        "torchtitan's Llama 3.1 8B job (`validators/torchtitan.py`: its parallelize function with op-level SAC and "
        "FSDP2, its step, 2 x 8,192 tokens per rank, the CUDA target; `python -m validators.bench --ranks`), one "
        "report at each world size, no processes (a fake process group): "
        + ", ".join(f"{n:,} ranks {r['report_s']:.1f} s ({len(r['roles'])} role{'s' if len(r['roles']) > 1 else ''}: "
                    f"{r['report_s'] / one['report_s']:.2f}x the time of one rank)" for n, r in found.items())
        + ". A role is a group of ranks with the same local shapes (uneven shards of the 128,256-row vocabulary "
          "over 1,024 ranks: 1,017 ranks of 126 rows, one of 114, six of none), captured once each: the first "
          "here, the others in worker processes (one per usable core, `estimator/orchestrate/workers.py`). FSDP2 "
          "chunks each parameter into `world_size` views to keep its rank's; the capture makes only the chunks it "
          "reads (`capture/world.py` `Chunks`): before both, 1,024 ranks took 180 s here.",
        RANKS_MARKS[1],
    ]) + "\n"


EXPERTS_MARKS = ("<!-- experts -->", "<!-- /experts -->")
EXPERT_RANKS = (8, 64)


def experts_case() -> dict:
    """Mixtral-8x7B's config on the meta device (bf16, AdamW, 4,096 tokens per rank, the CUDA target),
    FSDP2 over ``EXPERT_RANKS`` ranks with its 8 experts split over 8 of them by its own plans, its
    routers' picks assumed (``estimator/capture/routing.py``) at their bound and balanced."""
    import functools

    import estimator
    from estimator import Strategy, own_plans
    from transformers import MixtralConfig, MixtralForCausalLM

    with torch.device("meta"):
        model = MixtralForCausalLM(MixtralConfig()).to(torch.bfloat16)
    ids = torch.randint(0, 32000, (1, 4096))
    found = {}
    for ranks in EXPERT_RANKS:
        for policy in ("max", "balanced"):
            t = time.perf_counter()
            rep = estimator.report(model, {"input_ids": ids, "labels": ids}, batch=1, data_dependent=policy,
                                   device="cuda", strategy=Strategy(mesh={"fsdp": ranks},
                                                                    parallelize=functools.partial(own_plans, ep=8)))
            found[f"{ranks} {policy}"] = {"report_s": time.perf_counter() - t,
                                          "roles": [(len(r.ranks), r.report.peak_bytes) for r in rep.ranks]}
    return found


def experts_markdown(found: dict) -> str:
    def roles(r: dict) -> str:
        return " and ".join(f"{peak / 2**30:.1f} GiB on {n:,} rank{'s' if n > 1 else ''}" for n, peak in r["roles"])

    return "\n".join([
        EXPERTS_MARKS[0],
        "## Experts",
        "",
        "Mixtral-8x7B's config on the meta device (bf16, AdamW, one sequence of 4,096 tokens per rank, the CUDA "
        "target; `python -m validators.bench --experts`): FSDP2 over all ranks, the 8 experts split over each group "
        "of 8 by its own plans (`own_plans(ep=8)`: transformers' all-to-all token dispatch). No weights, so no "
        "routing: the routers' picks are assumed (`estimator/capture/routing.py`), at their bound (the default: every "
        "token to the same 2 experts, whose ranks receive every rank's tokens) or balanced "
        "(`data_dependent=\"balanced\"`). Ranks are captured once per group that holds the same shard shapes (over "
        "64 ranks, a router's 8-row weight: 8 ranks hold a row, 56 none) and receives alike: "
        + "; ".join(f"{key.replace('max', 'the bound').replace(' ', ' ranks, ', 1)}: {roles(r)} ({r['report_s']:.1f} s)"
                    for key, r in found.items()) + ".",
        EXPERTS_MARKS[1],
    ]) + "\n"


COMPARE_MARKS = ("<!-- compare -->", "<!-- /compare -->")


def compare_case() -> dict:
    return run_compare(*COMPARE_CASE)


def compare_markdown(compare: dict) -> str:
    ratio = compare["compare_s"] / compare["report_s"]
    return "\n".join([
        COMPARE_MARKS[0],
        "## compare",
        "",
        (f"`estimator.compare` of {compare['model']} {compare['size']} (b = {compare['batch']}, train, CPU; "
         f"`python -m validators.bench --compare`) over {len(compare['strategies'])} rows "
         f"({', '.join(compare['strategies'])}), after one `report` of the same model in the same process: "
         f"{compare['compare_s']:.1f} s against {compare['report_s']:.1f} s for the report: **{ratio:.2f}x** (target: "
         f"<= 2.5x). Its distinct steps are captured in worker processes ({compare['workers']} here, one per core; "
         "`estimator/orchestrate/workers.py`), the report's own capture is reused (`estimator/orchestrate/reuse.py`); "
         f"with every capture in this process (`workers=1`) it takes {compare['serial_s']:.1f} s. DDP, ZeRO and the "
         "pipeline's ranks transform captured steps; the captures, timed one by one in that run: "
         + ", ".join(f"{label} {t:.1f} s" for label, t in compare["captures_s"].items())
         + ". The compiled step's capture (Dynamo, AOTAutograd and Inductor's lowering, on fake tensors) is most of "
           "it, and bounds the ratio from below on two cores."
         + (f" The QLoRA row's model transform runs in this process before the captures: "
            f"{compare['qlora_transform_s'][0]:.1f} s the first time (importing PEFT, which imports transformers), "
            f"{compare['qlora_transform_s'][-1]:.1f} s once imported." if compare.get("qlora_transform_s") else "")),
        COMPARE_MARKS[1],
    ]) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validators.bench", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmark.md"))
    parser.add_argument("--compare", action="store_true", help="run the compare case only and write its section "
                        "of --out")
    parser.add_argument("--speed", choices=sorted(SPEED_CASES), help="run one model against the bare fake step, "
                        "in this process (prints it)")
    parser.add_argument("--speed-only", action="store_true", help="run the models against the bare fake step and "
                        "the cold start only (prints them)")
    parser.add_argument("--generate", action="store_true", help="run the generated-length case only and write "
                        "its section of --out")
    parser.add_argument("--depth", action="store_true", help="run the depth case only and write its section of "
                        "--out")
    parser.add_argument("--ranks", action="store_true", help="run the ranks case only and write its section of "
                        "--out")
    parser.add_argument("--experts", action="store_true", help="run the experts case only and write its section "
                        "of --out")
    parser.add_argument("--llama3-8b-child", type=int, metavar="NEW_TOKENS", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.llama3_8b_child is not None:  # (the generate case's 8B report, in a fresh process)
        print(json.dumps(_llama3_8b_child(args.llama3_8b_child)), flush=True)
        return 0
    for wanted, case, markdown, marks in ((args.generate, generate_case, generate_markdown, GENERATE_MARKS),
                                          (args.depth, depth_case, depth_markdown, DEPTH_MARKS),
                                          (args.compare, compare_case, compare_markdown, COMPARE_MARKS),
                                          (args.ranks, ranks_case, ranks_markdown, RANKS_MARKS),
                                          (args.experts, experts_case, experts_markdown, EXPERTS_MARKS)):
        if wanted:  # one section of --out
            found = case()
            print(json.dumps(found), flush=True)
            write_section(args.out, markdown(found), marks)
            return 0
    if args.speed:
        print(json.dumps(speed_case(args.speed)), flush=True)
        return 0
    speed = []
    for name in SPEED_CASES:
        speed.append(run_speed(name))
        print(json.dumps(speed[-1]), flush=True)
    cold = run_cold()
    print(json.dumps(cold), flush=True)
    if args.speed_only:
        return 0
    compare = compare_case()
    print(json.dumps(compare), flush=True)
    results = []
    for case in CASES:
        result = run_cold_and_warm(*case)
        print(json.dumps(result), flush=True)
        results.append(result)
    args.out.write_text(to_markdown(results, speed, cold) + "\n" + compare_markdown(compare) + "\n"
                        + generate_markdown(generate_case()) + "\n" + depth_markdown(depth_case()) + "\n"
                        + ranks_markdown(ranks_case()) + "\n" + experts_markdown(experts_case()) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
