"""``compare`` strategies side by side, and ``plan`` the ones that fit a memory budget.

Both run ``estimator.report`` for each strategy, but capture each distinct single-device step
once: DDP, ZeRO 1/2/3 and a pipeline's micro-batches are transformations of the same captured
step (``estimator.ranks.per_rank``); only mixed precision, checkpointing and accumulation
change what is captured.  A model that carries parallel plans (a transformers model's tensor-
parallel plan) is also offered on meshes of the devices: tensor parallelism within the mesh,
FSDP2 over the rest, each rank's step captured as its library's own code runs it
(``capture.model_plans``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from estimator.capture import model_plans, quantized, steps
from estimator.orchestrate.checked import device_name, sample_batch
from estimator.orchestrate.estimate import estimate_each
from estimator.reporting.result import Report
from estimator.vocab.errors import InputError
from estimator.vocab.request import Request
from estimator.vocab.strategy import Sharding, Strategy, blocks
from estimator.vocab.units import as_int, format_bytes, parse_bytes

BASELINE = "single device"


@dataclasses.dataclass(frozen=True)
class Row:
    """One strategy of a comparison, at the comparison's batch ``b`` (per device for data
    parallelism, per pipeline for a pipeline, per optimizer step for accumulation)."""

    label: str
    strategy: Strategy
    report: Report
    peak_bytes: int  # the worst device's peak at b (CUDA: max_memory_allocated)
    saving: float  # 1 - peak / the baseline's peak
    samples_per_step: int  # b times the data-parallel degree
    communication_bytes: int  # per device and step (ring algorithms), 0 on one device
    cost: str  # the extra compute or communication the strategy implies
    max_batch: int | None = None  # with a budget: the largest b that fits (0: none)
    optimizer: Any = None  # an optimizer what-if's optimizer (a name; None: the comparison's own)

    @property
    def devices(self) -> int:
        return self.strategy.devices

    @property
    def device_bytes(self) -> int | None:
        """CUDA: the worst device's memory (nvidia-smi) at b."""
        return self.report.device_bytes

    @property
    def fits(self) -> bool | None:
        return None if self.max_batch is None else self.max_batch >= self.report.batch

    @property
    def max_samples_per_step(self) -> int | None:
        return None if self.max_batch is None else self.max_batch * self.strategy.replicas


@dataclasses.dataclass(frozen=True)
class Comparison:
    """``compare``'s result: one ``Row`` per strategy, the baseline first."""

    rows: tuple[Row, ...]
    batch: int
    budget: int | None = None
    skipped: tuple[str, ...] = ()  # default strategies left out, and why
    baseline: str = BASELINE  # the label of the row the savings are relative to
    ranked: bool = False  # plan: rows best first

    def __getitem__(self, label: str) -> Row:
        for row in self.rows:
            if row.label == label:
                return row
        raise KeyError(f"no strategy {label!r}; rows: {[r.label for r in self.rows]}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "budget": self.budget,
            "rows": [
                {"label": r.label, "strategy": r.strategy.describe(), "optimizer": r.optimizer, "devices": r.devices,
                 "peak_bytes": r.peak_bytes, "device_bytes": r.device_bytes, "saving": r.saving,
                 "samples_per_step": r.samples_per_step, "communication_bytes": r.communication_bytes,
                 "cost": r.cost, "max_batch": r.max_batch, "fits": r.fits,
                 "per_device": r.report.per_device, "peak": str(r.report.peak)}
                for r in self.rows
            ],
            "skipped": list(self.skipped),
        }

    def __str__(self) -> str:
        from tabulate import tabulate

        cuda = self.rows[0].report.cuda is not None
        peaks = ["allocated per device", "reserved", "device memory"] if cuda else ["peak per device"]
        headers = [*(["#"] if self.ranked else []), "strategy", "devices", *peaks, "vs baseline",
                   "samples/step", *(["max b", "max samples/step"] if self.budget is not None else []),
                   "communication/step", "extra cost"]
        rows = []
        for i, r in enumerate(self.rows, 1):
            row = [*([i] if self.ranked else []), r.label, r.devices, format_bytes(r.peak_bytes)]
            if cuda:
                row += [format_bytes(r.report.reserved_bytes), format_bytes(r.device_bytes)]
            row += [f"{-100 * r.saving:+.1f} %" if r.label != self.baseline else "baseline", r.samples_per_step]
            if self.budget is not None:
                row += [r.max_batch, r.max_samples_per_step]
            row += [format_bytes(r.communication_bytes) if r.communication_bytes else "-", r.cost]
            rows.append(row)
        from estimator.reporting.render import target_text

        first = self.rows[0].report
        title = (f"fxmem {'plan' if self.ranked else 'compare'}: {first.model}, b = {self.batch}, "
                 f"{target_text(first.target)}")
        if self.budget is not None:
            title += f", budget {format_bytes(self.budget)} per device"
        lines = [title, "", tabulate(rows, headers=headers, disable_numparse=True)]
        lines += [f"note: {s}" for s in self.skipped]
        return "\n".join(lines)


def default_strategies(model: nn.Module, batch: int, devices: int = 4) -> tuple[dict[str, Strategy], list[str]]:
    """The strategies every guide names, for ``devices`` devices: one device, bf16 autocast,
    ``torch.compile``, checkpointing every block, DDP, ZeRO-1/2/3, a 1F1B pipeline (and, on 4
    or more devices, half as many stages with DDP over 2 pipelines) and, for a
    model that carries parallel plans, meshes of tensor parallelism and FSDP2
    (``mesh_strategies``); the ones the model or ``batch`` cannot take are left out (with the
    reason)."""
    found = blocks(model)
    out = {BASELINE: Strategy(), "AMP bf16": Strategy(amp="bf16"), "compiled": Strategy(compile=True)}
    skipped = []
    if found:
        out[f"checkpoint {type(found[0][1]).__name__}"] = Strategy(checkpoint=type(found[0][1]))
    else:
        skipped.append("checkpointing: the model has no repeated blocks (nn.Sequential / nn.ModuleList children)")
    if devices > 1:
        out[f"DDP x{devices}"] = Strategy(data_parallel=devices)
        for stage in Sharding:
            out[f"ZeRO-{stage.value[-1]} x{devices}"] = Strategy(data_parallel=devices, sharding=stage)
        if len(found) < devices:
            skipped.append(f"pipeline: {len(found)} blocks cannot make {devices} stages")
        elif batch % devices:
            skipped.append(f"pipeline: b={batch} does not split into {devices} micro-batches")
        else:
            out[f"pipeline x{devices} (1F1B)"] = Strategy(pipeline=devices)
            if devices >= 4 and devices % 2 == 0:  # the same micro-batch (b / devices): the same capture
                out[f"pipeline x{devices // 2} x DDP 2 (1F1B)"] = Strategy(pipeline=devices // 2, data_parallel=2,
                                                                           microbatches=devices)
        out |= mesh_strategies(model, devices)
    return out, skipped


def mesh_strategies(model: nn.Module, devices: int) -> dict[str, Strategy]:
    """``devices`` ranks as tensor parallelism over 2, 4 or 8 of them (dividing ``devices`` and
    the model's heads) and FSDP2 over the rest, and for an MoE FSDP2 over all of them with its
    experts split over as many as divide both (``model_plans.ep_size``), by the model's own plans
    (``capture.model_plans.own_plans``); none where the model carries none."""
    if not model_plans.carries_plans(model):
        return {}
    out = {}
    for tp in model_plans.tp_sizes(model, devices):
        mesh = model_plans.mesh_for(devices, tp)
        label = " x ".join([*([f"FSDP2 x{mesh['dp_shard']}"] if "dp_shard" in mesh else []), f"TP {tp}"])
        out[f"{label} (its own plans)"] = Strategy(mesh=mesh, parallelize=model_plans.own_plans)
    ep = model_plans.ep_size(model, devices)
    if ep > 1:
        out[f"FSDP2 x{devices} + EP {ep} (its own plans)"] = Strategy(
            mesh={"dp_shard": devices}, parallelize=functools.partial(model_plans.own_plans, ep=ep))
    return out


# Optimizer what-ifs of compare and plan: the low-bit version of the optimizer named, by label,
# where its library is installed (estimator.capture.steps.LOW_BIT_OPTIMIZERS).  bitsandbytes' only:
# torchao's compile their update per parameter shape, which would make every compare compile
# (pass optimizers={"4-bit AdamW (torchao)": "adamw_torch_4bit"} for it).  On a GPU also AdamW
# stepped on the CPU (torchao's CPUOffloadOptimizer: fused CPU AdamW, no compile).
LOW_BIT_WHAT_IFS = {
    "adamw": {"8-bit AdamW (bitsandbytes)": "adamw8bit"},
    "adam": {"8-bit Adam (bitsandbytes)": "adam8bit"},
}
GPU_WHAT_IFS = {"adamw": {"AdamW offloaded to the CPU (torchao)": "cpu_offload_adamw"}}


def _library(optimizer: Any) -> str | None:
    """The library of a low-bit optimizer name (``steps.LOW_BIT_OPTIMIZERS``), else None."""
    if not isinstance(optimizer, str):
        return None
    found = steps.LOW_BIT_OPTIMIZERS.get(optimizer.lower().replace("_", "").replace("-", ""))
    return None if found is None else found[0].split(".")[0]


def default_optimizers(optimizer: Any, mode: str = "train", device: str = "cpu") -> tuple[dict[str, str], list[str]]:
    """The what-ifs of ``optimizer`` (``LOW_BIT_WHAT_IFS``, and ``GPU_WHAT_IFS`` on the CUDA
    target; by label) for a train step with an optimizer given by name, and the ones left out
    (their library is not installed)."""
    import importlib.util

    if not isinstance(optimizer, str) or not isinstance(mode, str) or mode.lower() != "train":
        return {}, []
    found, skipped = {}, []
    what_ifs = {**LOW_BIT_WHAT_IFS.get(optimizer.lower(), {}),
                **(GPU_WHAT_IFS.get(optimizer.lower(), {}) if device_name(device) == "cuda" else {})}
    for label, name in what_ifs.items():
        library = _library(name)
        if importlib.util.find_spec(library) is None:
            skipped.append(f"{label}: {library} is not installed (pip install {library})")
        else:
            found[label] = name
    return found, skipped


QLORA = "QLoRA (NF4 weights + LoRA r=8)"  # the weights what-if of compare and plan


def qlora(model: nn.Module) -> nn.Module:
    """``model`` as QLoRA trains it (Dettmers et al. 2023, as PEFT and transformers users build it):
    a copy on the meta device (no values: sizes only), every linear but the output embeddings in
    bitsandbytes NF4 with double quantization and bf16 compute (``capture.quantized.nf4_linears``:
    what ``BitsAndBytesConfig(load_in_4bit=True, ...)`` loads), every weight frozen, and PEFT's
    LoRA adapters (``LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")``, PEFT's
    defaults otherwise) the only trainable parameters.  The rest of the step is the
    comparison's own (its optimizer over the adapters; no ``prepare_model_for_kbit_training``)."""
    import copy

    import peft
    import torch

    memo = {id(t): type(t)(torch.empty_like(t, device="meta"), requires_grad=False) if isinstance(t, nn.Parameter)
            else torch.empty_like(t, device="meta") for t in [*model.parameters(), *model.buffers()]}
    copied = copy.deepcopy(model, memo)
    head = getattr(copied, "get_output_embeddings", None)
    head = head() if callable(head) else None
    quantized.nf4_linears(copied, keep=(head,) if isinstance(head, nn.Module) else ())
    copied.requires_grad_(False)
    return peft.get_peft_model(copied, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))


def default_weights(model: nn.Module, mode: Any = "train") -> tuple[dict[str, Any], list[str]]:
    """The weights what-ifs of a train step (``{label: model transform}``: ``QLORA``) where
    bitsandbytes and PEFT are installed and linear layers hold at least half of the model's
    parameters (a transformer's, not a conv net's classifier), and the ones left out."""
    import importlib.util

    if not isinstance(mode, str) or mode.lower() != "train":
        return {}, []
    linear = {id(m.weight): m.weight.numel() for m in model.modules() if type(m) is nn.Linear}
    total = sum(p.numel() for p in model.parameters())
    if not linear:
        return {}, [f"{QLORA}: the model has no nn.Linear layers"]
    if 2 * sum(linear.values()) < total:  # QLoRA quantizes linears: a conv net's classifier is not the model
        return {}, [f"{QLORA}: its linear layers hold {sum(linear.values()) / total:.0%} of the parameters "
                    "(weights={...} asks for it)"]
    missing = [name for name in ("bitsandbytes", "peft") if importlib.util.find_spec(name) is None]
    if missing:
        return {}, [f"{QLORA}: {' and '.join(missing)} not installed (pip install {' '.join(missing)})"]
    return {QLORA: qlora}, []


def compare(
    model: nn.Module,
    sample: Any,
    batch: int | None = None,
    strategies: Sequence[Strategy] | Mapping[str, Strategy] | None = None,
    *,
    devices: int = 4,
    budget: int | str | None = None,
    mode: str = "train",
    optimizer="adamw",
    loss_fn=None,
    device: str = "cuda",
    gpu: str | int | None = None,
    alloc_conf: str | None = None,
    dynamic: Mapping | None = None,
    data_dependent: Any = "max",
    batch_dims: int | Mapping | None = None,
    keep_output: bool | None = None,
    optimizers: Mapping[str, Any] | None = None,
    weights: Mapping[str, Any] | None = None,
    workers: int | None = None,
) -> Comparison:
    """Each strategy's peak per device at batch ``b`` (and, with a ``budget``, the largest
    ``b`` that fits), against the single-device baseline (the first row).

    ``strategies``: ``Strategy`` objects (labelled by ``Strategy.describe()``) or a
    ``{label: Strategy}`` dict; default ``default_strategies(model, b, devices)``.
    ``optimizers``: what-ifs of the optimizer on one device, ``{label: optimizer}`` (a name or a
    factory, as ``optimizer``); default, with the default strategies, ``default_optimizers``:
    bitsandbytes' 8-bit version of ``"adamw"`` / ``"adam"`` where it is installed.  ``weights``:
    what-ifs of the model on one device, ``{label: model -> model}``; default, with the default
    strategies, ``default_weights``: QLoRA (``qlora``) where bitsandbytes and PEFT are installed.  The other
    arguments are ``estimator.report``'s (``device="cuda"`` by default, on the GPU ``gpu=``,
    default an H100; a user's own ``step=`` cannot combine with the strategies compared:
    estimate it with ``report``).  Each distinct single-device step is captured once, in
    ``workers`` processes forked from this one (None: one per usable core; 1: in this process),
    and kept for later reports of the same step (``estimator.forget_captures()`` drops them).
    """
    devices = as_int(devices, "devices")
    limit = None if budget is None else parse_bytes(budget)
    skipped: list[str] = []
    if optimizers is None:
        optimizers, left_out = default_optimizers(optimizer, mode, device) if strategies is None else ({}, [])
        skipped += left_out
    elif not isinstance(optimizers, Mapping):
        raise InputError(f"optimizers must be a dict {{label: optimizer}}, got {type(optimizers).__name__}")
    elif optimizers and str(mode).lower() != "train":
        raise InputError(f"optimizers are what-ifs of a train step; mode={mode!r} runs no optimizer")
    defaults = weights is None
    if defaults:
        weights, left_out = default_weights(model, mode) if strategies is None else ({}, [])
        skipped += left_out
    elif not isinstance(weights, Mapping) or not all(callable(w) for w in weights.values()):
        raise InputError("weights must be a dict {label: function(model) -> model}")
    transformed = {}
    for label, what_if in weights.items():
        try:
            transformed[label] = _transformed(label, what_if, model)
        except InputError as exc:
            if not defaults:
                raise
            skipped.append(str(exc))
    if strategies is None:
        named, more = default_strategies(model, batch or sample_batch(sample, batch_dims), devices)
        skipped += more
    elif isinstance(strategies, Mapping):
        named = dict(strategies)
    else:
        named = {}
        for s in strategies:
            if not isinstance(s, Strategy):
                raise InputError(f"strategies must be estimator.Strategy objects, got {type(s).__name__}")
            named.setdefault(s.describe(), s)
    if BASELINE not in named and Strategy() not in named.values():
        named = {BASELINE: Strategy(), **named}
    request = Request(model, sample, batch=batch, mode=mode, optimizer=optimizer, loss_fn=loss_fn, device=device,
                      gpu=gpu, alloc_conf=alloc_conf, dynamic=dynamic, data_dependent=data_dependent,
                      batch_dims=batch_dims, keep_output=keep_output)
    clash = sorted((set(optimizers) & set(named)) | (set(transformed) & (set(named) | set(optimizers))))
    if clash:
        raise InputError(f"strategies and what-ifs share the label(s) {', '.join(map(repr, clash))}")
    requests = {label: request.replace(strategy=s) for label, s in named.items()}
    requests |= {label: request.replace(optimizer=o) for label, o in optimizers.items()}
    requests |= {label: request.replace(model=m) for label, m in transformed.items()}
    reports = estimate_each(requests, workers)
    base_label = next(label for label, s in named.items() if s == Strategy())
    base = reports[base_label]
    rows = []
    for label, rep in reports.items():
        s = named.get(label, Strategy())
        rows.append(Row(
            label=label,
            strategy=s,
            report=rep,
            peak_bytes=rep.peak_bytes,
            saving=1 - rep.peak_bytes / base.peak_bytes,
            samples_per_step=rep.batch * s.replicas,
            communication_bytes=communication_bytes(requests[label].model, s),
            cost=cost(s) if label in named else optimizer_cost(optimizers[label]) if label in optimizers else
            WEIGHTS_COST,
            max_batch=None if limit is None else rep.max_batch(limit),
            optimizer=_optimizer_label(optimizers[label]) if label in optimizers else None,
        ))
    rows.sort(key=lambda r: r.label != base_label)  # the baseline first, the rest in the given order
    return Comparison(tuple(rows), rows[0].report.batch, limit, tuple(skipped), base_label)


def plan(
    model: nn.Module,
    sample: Any,
    budget: int | str | None = None,
    devices: int = 1,
    *,
    strategies: Sequence[Strategy] | Mapping[str, Strategy] | None = None,
    **options,
) -> Comparison:
    """The strategies for ``devices`` devices whose step fits ``budget`` per device (bytes or
    ``"80GiB"``; default: the memory of the GPU ``gpu=``, an H100 by default; ``device="cpu"``
    needs one), ranked by the most samples per optimizer step they allow (``max_batch`` times
    the data-parallel degree), then by the least communication.  ``strategies`` default:
    ``default_strategies`` plus their combinations with bf16 autocast and checkpointing.
    Options: as ``compare``."""
    batch = options.pop("batch", None)
    if budget is None and device_name(options.get("device", "cuda")) != "cuda":
        raise InputError("plan needs a budget per device (bytes or e.g. '80GiB') with device='cpu'; on a GPU "
                         "(device='cuda', the default) it defaults to the GPU's memory")
    if strategies is None:
        options.setdefault("optimizers", default_optimizers(options.get("optimizer", "adamw"),
                                                            options.get("mode", "train"),
                                                            options.get("device", "cuda"))[0])
        options.setdefault("weights", default_weights(model, options.get("mode", "train"))[0])
        named, _ = default_strategies(model, batch or sample_batch(sample, options.get("batch_dims")), devices)
        found = blocks(model)
        extra = {}
        for label, s in named.items():
            if s.amp is None and s.pipeline == 1 and not s.compile:
                extra[f"{label} + AMP bf16"] = dataclasses.replace(s, amp="bf16")
                if s.checkpoint is None and found:
                    extra[f"{label} + AMP bf16 + checkpoint"] = dataclasses.replace(
                        s, amp="bf16", checkpoint=type(found[0][1]))
        strategies = {**named, **{k: v for k, v in extra.items() if k not in named and v not in named.values()}}
    result = compare(model, sample, batch, strategies, devices=devices, budget=_budget(budget, options), **options)
    fitting = [r for r in result.rows if r.max_batch]
    fitting.sort(key=lambda r: (-r.max_samples_per_step, r.communication_bytes, r.devices))
    dropped = tuple(f"{r.label}: does not fit at any b" for r in result.rows if not r.max_batch)
    if not fitting:
        raise InputError(f"no strategy fits {format_bytes(result.budget)} per device on {devices} device(s) at any "
                         f"batch size: {'; '.join(dropped)}")
    return dataclasses.replace(result, rows=tuple(fitting), skipped=result.skipped + dropped, ranked=True)


def _budget(budget, options) -> int | None:
    if budget is not None:
        return parse_bytes(budget)
    from estimator.vocab.target import target_spec

    spec, _ = target_spec("cuda", options.get("gpu"), options.get("alloc_conf"))
    return spec.gpu.total_memory


# ----------------------------------------------------------------------------------------
# what a strategy costs besides memory


def communication_bytes(model: nn.Module, strategy: Strategy) -> int:
    """Bytes each device sends per optimizer step with ring collectives (``n`` ranks move
    ``(n-1)/n`` of the data per all-gather / reduce-scatter, twice that per all-reduce), for
    the gradients ``G`` and parameters ``P`` of the trainable parameters: DDP all-reduces G;
    ZeRO-1 adds the parameter broadcast (P); ZeRO-2 all-gathers P once and reduce-scatters G;
    ZeRO-3 all-gathers P twice (forward and backward).  Pipelines send activations: not
    counted (0); a pipeline's DDP all-reduces each stage's gradients, taken as ``P / S`` (the
    cut's own shares are not used).  On a mesh, its data-parallel ranks are counted as ZeRO-3's (FSDP2) on the
    ``P / t`` each tensor-parallel group of ``t`` holds, and with expert parallelism over ``e``
    ranks the expert weights ``E`` as ZeRO-3's on the ``E / e`` each holds, over the ``n·t / e``
    ranks that hold the same experts; tensor parallelism's own traffic and expert parallelism's
    tokens (activations) are not counted, nor is anything else your parallel code sends."""
    p = sum(t.numel() * t.element_size() for t in model.parameters() if t.requires_grad)
    if strategy.mesh is not None:
        n, tp = strategy.replicas, strategy.devices // strategy.replicas
        ep = model_plans.ep_of(strategy.parallelize)
        expert = model_plans.experts(model)[1] if ep > 1 else 0
        same = n * tp // ep  # the ranks that hold one expert shard
        return round((n - 1) / n * 3 * (p - expert) / tp + (same - 1) / same * 3 * expert / ep)
    n = strategy.data_parallel
    if n == 1:
        return 0
    share = (n - 1) / n
    p //= strategy.pipeline
    volume = {None: 2 * p, Sharding.ZERO1: 3 * p, Sharding.ZERO2: 2 * p, Sharding.ZERO3: 3 * p}[strategy.sharding]
    # accumulating, DDP reduces once (no_sync); FSDP gathers and reduce-scatters every micro-step
    return round(share * volume * (strategy.accumulate if strategy.sharding in (Sharding.ZERO2, Sharding.ZERO3) else 1))


WEIGHTS_COST = ("a different fine-tune: LoRA adapters trained, the base weights frozen in 4-bit and dequantized "
                "at every matmul (forward and backward)")


def _transformed(label: str, what_if, model: nn.Module) -> nn.Module:
    try:
        return what_if(model)
    except InputError:
        raise
    except Exception as exc:  # a library's refusal of this model, named
        raise InputError(f"the what-if {label!r} could not transform the model: {type(exc).__name__}: {exc}") from exc


def optimizer_cost(optimizer: Any) -> str:
    """What an optimizer what-if costs besides memory, in words."""
    library = _library(optimizer)
    if library is not None and "offload" in optimizer.lower():
        return (f"steps on the CPU, the state in host memory; gradients to the host and parameters back every "
                f"step ({library})")
    if library is not None:
        return f"quantizes the optimizer state at every step (block-wise, {library})"
    return f"optimizer {_optimizer_label(optimizer)}"


def _optimizer_label(optimizer: Any) -> str:
    return optimizer if isinstance(optimizer, str) else getattr(optimizer, "__name__", type(optimizer).__name__)


def cost(strategy: Strategy) -> str:
    """What the strategy costs besides memory, in words."""
    parts = []
    if strategy.checkpoint is not None:
        parts.append("recomputes the checkpointed forward in backward")
    if strategy.accumulate > 1:
        parts.append(f"{strategy.accumulate} sequential micro-steps")
    if strategy.amp is not None:
        parts.append("casts (faster low-precision matmuls)")
    if strategy.data_parallel > 1:
        parts.append({None: "all-reduce of gradients", Sharding.ZERO1: "all-reduce + parameter broadcast",
                      Sharding.ZERO2: "all-gather + reduce-scatter",
                      Sharding.ZERO3: "2 all-gathers + reduce-scatter"}[strategy.sharding])
    if strategy.compile:
        parts.append("compiles at the first step (and again at a new batch size)")
    if strategy.mesh is not None:
        parts.append("your parallel code's collectives: FSDP2's on the dp dims (counted), tensor parallelism's of "
                     "activations (not)" + (", expert parallelism's all-to-alls of tokens (not)"
                                            if model_plans.ep_of(strategy.parallelize) > 1 else ""))
    if strategy.pipeline > 1:
        s, m = strategy.pipeline, strategy.microbatches
        bubble = (s - 1) / (m + s - 1)
        parts.append(f"pipeline bubble {100 * bubble:.0f} % ({strategy.schedule.value}); activations sent between "
                     "stages")
    return "; ".join(parts) or "-"

