"""How the step is spread over time and devices: ``Strategy``.

Single process:

- ``accumulate=k``: gradient accumulation over ``k`` micro-batches.  The batch ``b`` given to
  ``report``/``Report.at`` is the batch of one optimizer step; each micro-step runs ``b / k``
  samples (``b`` must be a multiple of ``k``).  The step (``estimator.capture.steps.train_step``)::

      for micro in chunks(sample, k):        # views of the full batch, which stays alive
          out = model(micro); loss = loss_fn(out, micro) / k
          loss.backward()                    # the 2nd and later ones add into .grad
      optimizer.step(); optimizer.zero_grad(set_to_none=True)

- ``checkpoint``: activation checkpointing of modules, by path (``"transformer.h.0"``), glob
  (``"transformer.h.*"``), a tuple of those, or a module type (``Block``: every instance).
  Their forward runs inside ``torch.utils.checkpoint.checkpoint(..., use_reentrant=
  checkpoint_reentrant)`` and is recomputed in backward.

Several devices, as the job runs them: ``mesh`` and ``parallelize`` (the user's own
parallelize function, run in the capture of each rank: ``estimator.capture.world``).  Or as
fxmem models them (``estimator.ranks.per_rank`` turns the captured step into each rank's):
``data_parallel`` replicas (DDP) or shards (``sharding`` ZeRO 1/2/3), ``pipeline`` stages.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import fnmatch
import functools
import math
import numbers
from collections.abc import Callable, Mapping

from torch import nn

from estimator.vocab.errors import InputError


class Sharding(str, enum.Enum):
    """What the data-parallel ranks shard, by the PyTorch implementation fxmem models.

    ``zero1``: optimizer state (``torch.distributed.optim.ZeroRedundancyOptimizer`` over DDP:
    each rank updates and keeps the state of whole parameters, assigned greedily by size).
    ``zero2``: + gradients and parameters between steps (FSDP2 ``fully_shard(...,
    reshard_after_forward=False)``: the gathered parameters stay until backward ends).
    ``zero3``: + parameters between forward and backward (``fully_shard(...,
    reshard_after_forward=True)``, i.e. FSDP's FULL_SHARD).
    """

    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"


class Schedule(str, enum.Enum):
    """Pipeline schedules (``torch.distributed.pipelining``)."""

    GPIPE = "gpipe"  # ScheduleGPipe: every micro-batch's forward, then every backward
    ONE_F_ONE_B = "1f1b"  # Schedule1F1B: stage i keeps at most (stages - i) micro-batches in flight


ModuleSelection = tuple[str, ...] | str | type | None
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile(mode=)


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How one training step is spread over time and devices.

    Single process: ``accumulate`` micro-batches per optimizer step; ``checkpoint`` the
    modules whose activations are recomputed in backward; ``amp`` mixed precision
    (``"fp16"``/``"bf16"`` autocast, ``grad_scaler``: as ``report(amp=, grad_scaler=)``);
    ``master_weights``: a model with low-precision parameters (``model.to(torch.bfloat16)``)
    trained through fp32 master copies (``estimator.capture.steps.MasterWeights``).

    Data parallel over ``data_parallel`` ranks, each running ``b`` samples per step (the
    global batch is ``data_parallel * b``): DDP replicas (``bucket_cap_mb``,
    ``gradient_as_bucket_view`` as ``DistributedDataParallel`` takes them), or ``sharding``
    ZeRO stage 1/2/3 (``Sharding``); ``shard_modules`` the modules ``fully_shard`` wraps
    (path, glob, tuple or type; default: the model's blocks -- the children of its first
    ``nn.Sequential`` / ``nn.ModuleList`` that hold parameters -- and the root).

    Pipeline over ``pipeline`` stages: the blocks are cut into contiguous stages
    (``split_points``: the block paths where stages 2.. start; default: balanced by memory),
    the batch ``b`` into ``microbatches`` (default: ``pipeline``) run by ``schedule``.  With
    ``data_parallel`` > 1, that many pipelines, each stage's replicas under DDP (``pipeline *
    data_parallel`` ranks, each pipeline running ``b`` samples a step).

    ``compile``: the model ``torch.compile``d (True, or a mode name), as ``report(compile=)``.

    A job's own parallelism: ``mesh`` the device mesh, ``{dim name: size}`` outermost first
    (``{"dp_shard": 4, "tp": 2}``: 8 ranks), and ``parallelize`` the function the job applies to
    its model, ``fn(model, mesh)`` with a ``DeviceMesh`` of those dims (``fully_shard``,
    ``parallelize_module``, ...), changing the model in place.  ``b`` is then each rank's batch.
    """

    accumulate: int = 1
    checkpoint: ModuleSelection = None
    checkpoint_reentrant: bool = False
    amp: str | None = None
    grad_scaler: bool | None = None
    master_weights: bool = False
    data_parallel: int = 1
    sharding: Sharding | str | None = None
    shard_modules: ModuleSelection = None
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    pipeline: int = 1
    microbatches: int | None = None
    schedule: Schedule | str = Schedule.ONE_F_ONE_B
    split_points: tuple[str, ...] | None = None
    compile: bool | str = False
    mesh: Mapping[str, int] | tuple[tuple[str, int], ...] | None = None
    parallelize: Callable | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.compile, bool) and self.compile not in COMPILE_MODES:
            raise InputError(f"Strategy(compile=) must be True, False or a torch.compile mode "
                             f"({', '.join(COMPILE_MODES)}), got {self.compile!r}")
        for name in ("accumulate", "data_parallel", "pipeline"):
            _positive_int(self, name)
        if self.microbatches is not None:
            _positive_int(self, "microbatches")
        for name in ("checkpoint", "shard_modules"):
            _selection(self, name)
        if self.amp is not None and self.amp not in ("fp16", "bf16"):
            raise InputError(f"Strategy(amp=) must be 'fp16', 'bf16' or None, got {self.amp!r}")
        if self.grad_scaler is not None and not isinstance(self.grad_scaler, bool):
            raise InputError(f"Strategy(grad_scaler=) must be True, False or None, got {self.grad_scaler!r}")
        for name in ("checkpoint_reentrant", "gradient_as_bucket_view", "master_weights"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"Strategy({name}=) must be True or False, got {getattr(self, name)!r}")
        _enum(self, "sharding", Sharding, optional=True)
        _enum(self, "schedule", Schedule)
        self._check_mesh()
        cap = self.bucket_cap_mb
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
            raise InputError(f"Strategy(bucket_cap_mb=) must be a positive number of MiB, got {cap!r}")
        if isinstance(self.split_points, (str, list)):
            object.__setattr__(self, "split_points", (self.split_points,) if isinstance(self.split_points, str)
                               else tuple(self.split_points))
        sharded = self.sharding is not None
        if sharded and self.data_parallel < 2:
            raise InputError(f"Strategy(sharding={self.sharding.value!r}) shards over the data-parallel ranks: "
                             f"give data_parallel >= 2, got {self.data_parallel}")
        if self.master_weights and self.sharding in (Sharding.ZERO2, Sharding.ZERO3):
            raise InputError("Strategy(master_weights=True) with sharding='zero2'/'zero3' is not modelled (FSDP "
                             "keeps low-precision copies itself: MixedPrecisionPolicy); use fp32 parameters")
        if self.shard_modules is not None and self.sharding not in (Sharding.ZERO2, Sharding.ZERO3):
            raise InputError("Strategy(shard_modules=) chooses the fully_shard units of sharding='zero2'/'zero3'")
        if not sharded and self.data_parallel == 1 and (self.gradient_as_bucket_view or cap != 25.0):
            raise InputError("Strategy(bucket_cap_mb=, gradient_as_bucket_view=) configure DDP: give data_parallel >= 2")
        if self.pipeline == 1:
            for name in ("microbatches", "split_points"):
                if getattr(self, name) is not None:
                    raise InputError(f"Strategy({name}=) configures a pipeline: give pipeline >= 2 stages")
            return
        if self.sharding is not None:
            raise InputError(f"Strategy(pipeline=) with sharding={self.sharding.value!r}: fxmem's own pipeline "
                             "model gives each stage's data-parallel ranks as DDP replicas (leave sharding=None); "
                             "FSDP2 of the stages runs as your job writes it: Strategy(mesh={'pp': S, 'dp_shard': D}, "
                             "parallelize=fn), fn cutting the model to the rank's stage, sharding it and returning "
                             "its pipeline schedule (models_zoo/parallelize.py sequential_pipeline is one)")
        if self.accumulate > 1:
            raise InputError(
                "Strategy(pipeline=) with accumulate > 1: a pipeline already accumulates its micro-batches; "
                f"use microbatches={self.accumulate * (self.microbatches or self.pipeline)} instead")
        if self.split_points is not None:
            if not self.split_points or not all(isinstance(p, str) for p in self.split_points):
                raise InputError(f"Strategy(split_points=) must be module paths, got {self.split_points!r}")
            if len(self.split_points) != self.pipeline - 1:
                raise InputError(f"Strategy(split_points=) needs pipeline - 1 = {self.pipeline - 1} module paths "
                                 f"(where stages 2.. start), got {len(self.split_points)}")
        if self.microbatches is None:
            object.__setattr__(self, "microbatches", self.pipeline)

    def _check_mesh(self) -> None:
        """``mesh`` as ``(name, size)`` pairs (hashable), named dims of positive sizes, with a
        ``parallelize`` function, and none of fxmem's own models of the same thing."""
        if self.mesh is None:
            if self.parallelize is not None:
                raise InputError("Strategy(parallelize=) needs the mesh it is run on: give mesh={dim name: size}")
            return
        items = tuple(self.mesh.items()) if isinstance(self.mesh, Mapping) else self.mesh
        if (not isinstance(items, tuple) or not items or
                not all(isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) and i[0] for i in items)):
            raise InputError(f"Strategy(mesh=) must be a dict {{dim name: size}}, e.g. {{'dp_shard': 4, 'tp': 2}}, "
                             f"got {self.mesh!r}")
        for name, size in items:
            if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
                raise InputError(f"Strategy(mesh=): dim {name!r} must have a positive int size, got {size!r}")
        if len({name for name, _ in items}) != len(items):
            raise InputError(f"Strategy(mesh=) names a dim twice: {[name for name, _ in items]}")
        object.__setattr__(self, "mesh", tuple((name, int(size)) for name, size in items))
        if not callable(self.parallelize):
            raise InputError("Strategy(mesh=) runs the job's own parallelize function on each rank: give "
                             f"parallelize=fn (fn(model, mesh)), got {self.parallelize!r}")
        modelled = [name for name in ("data_parallel", "pipeline") if getattr(self, name) > 1]
        modelled += [name for name in ("sharding", "shard_modules", "split_points") if getattr(self, name) is not None]
        modelled += ["master_weights"] * self.master_weights + ["compile"] * bool(self.compile)
        if modelled:
            raise InputError(f"Strategy(mesh=, parallelize=) runs your own parallel code; {', '.join(modelled)} "
                             "describe(s) fxmem's models of it (or, for compile and master_weights, is not "
                             "combined with a mesh yet): give one or the other")

    @property
    def distributed(self) -> bool:
        """Whether the step runs on more than one device (per-rank results)."""
        return self.data_parallel > 1 or self.pipeline > 1 or self.mesh is not None

    @property
    def devices(self) -> int:
        if self.mesh is not None:
            return math.prod(size for _, size in self.mesh)
        return self.data_parallel * self.pipeline

    @property
    def replicas(self) -> int:
        """The data-parallel degree: ranks that each run ``b`` samples of their own.  On a mesh,
        the dims named ``dp*`` (torchtitan's ``dp_replicate`` / ``dp_shard``) or ``fsdp``
        (transformers')."""
        if self.mesh is not None:
            return math.prod(size for name, size in self.mesh if name.startswith("dp") or name == "fsdp")
        return self.data_parallel

    @property
    def multiple(self) -> int:
        """What ``b`` must be a multiple of: micro-batches of equal size."""
        return self.accumulate * (self.microbatches or 1)

    def check_batch(self, batch: int) -> None:
        """``batch`` must split into equal micro-batches."""
        if batch % self.multiple:
            what = (f"accumulate={self.accumulate}" if self.pipeline == 1
                    else f"microbatches={self.microbatches}")
            raise InputError(
                f"Strategy({what}) needs a batch size that is a multiple of {self.multiple}, got b={batch}"
            )

    def describe(self) -> str:
        """A short label: ``"DDP x4 + checkpoint(Block) + accumulate 2"``."""
        parts = []
        if self.mesh is not None:
            dims = ", ".join(f"{name}={size}" for name, size in self.mesh)
            parts.append(f"mesh {dims} ({function_name(self.parallelize)})")
        elif self.pipeline > 1:
            name = "GPipe" if self.schedule is Schedule.GPIPE else "1F1B"
            parts.append(f"pipeline x{self.pipeline} ({name}, {self.microbatches} micro-batches)"
                         + (f" x DDP {self.data_parallel}" if self.data_parallel > 1 else ""))
        elif self.sharding is not None:
            parts.append(f"ZeRO-{self.sharding.value[-1]} x{self.data_parallel}")
        elif self.data_parallel > 1:
            parts.append(f"DDP x{self.data_parallel}" + (" (grad bucket view)" if self.gradient_as_bucket_view else ""))
        if self.amp is not None:
            parts.append(f"AMP {self.amp}" + (" + GradScaler" if self.grad_scaler else ""))
        if self.master_weights:
            parts.append("fp32 master weights")
        if self.checkpoint is not None:
            what = self.checkpoint.__name__ if isinstance(self.checkpoint, type) else self.checkpoint
            parts.append(f"checkpoint {what}" + (" (reentrant)" if self.checkpoint_reentrant else ""))
        if self.accumulate > 1:
            parts.append(f"accumulate {self.accumulate}")
        if self.compile:
            parts.append("compiled" + (f" ({self.compile})" if isinstance(self.compile, str) else ""))
        return " + ".join(parts) or "single device"

    def checkpointed(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The ``(path, module)`` pairs selected by ``checkpoint`` (outermost only: a selected
        module inside another selected one is recomputed with it)."""
        return select(model, self.checkpoint, "checkpoint")


def function_name(fn: Callable) -> str:
    """A function's name for messages: a ``functools.partial``'s function's."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _positive_int(strategy: Strategy, name: str) -> None:
    """A positive integer (``numbers.Integral``: numpy's too), stored as an ``int``."""
    value = getattr(strategy, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InputError(f"Strategy({name}=) must be a positive int, got {value!r}")
    object.__setattr__(strategy, name, int(value))


def _selection(strategy: Strategy, name: str) -> None:
    value = getattr(strategy, name)
    if isinstance(value, list):
        object.__setattr__(strategy, name, value := tuple(value))
    valid = (
        value is None
        or isinstance(value, str)
        or (isinstance(value, type) and issubclass(value, nn.Module))
        or (isinstance(value, tuple) and value and all(isinstance(p, str) for p in value))
    )
    if not valid:
        raise InputError(
            f"Strategy({name}=) must be a module path or glob ('transformer.h.*'), a tuple of them, "
            f"or an nn.Module subclass, got {value!r}"
        )


def _enum(strategy: Strategy, name: str, cls: type[enum.Enum], optional: bool = False) -> None:
    value = getattr(strategy, name)
    if value is None and optional:
        return
    try:
        object.__setattr__(strategy, name, cls(value))
    except ValueError:
        raise InputError(f"Strategy({name}=) must be one of {[m.value for m in cls]}, got {value!r}") from None


def select(model: nn.Module, selection: ModuleSelection, what: str) -> list[tuple[str, nn.Module]]:
    """The ``(path, module)`` pairs of ``model`` that ``selection`` names (a path, a glob, a
    tuple of them, or a module type: every instance), outermost only; ``InputError`` naming
    ``Strategy(what=)`` when one names nothing."""
    if selection is None:
        return []
    named = list(model.named_modules())
    if isinstance(selection, type):
        found = [(p, m) for p, m in named if isinstance(m, selection)]
        if not found:
            types = sorted({type(m).__name__ for _, m in named})
            raise InputError(
                f"Strategy({what}={selection.__name__}): the model has no instance of it "
                f"(its module types: {', '.join(types)})"
            )
    else:
        patterns = (selection,) if isinstance(selection, str) else selection
        paths = [p for p, _ in named if p]
        found = []
        for pattern in patterns:
            hits = [(p, m) for p, m in named if p and fnmatch.fnmatchcase(p, pattern)]
            if not hits:
                close = difflib.get_close_matches(pattern, paths, n=3)
                hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
                raise InputError(f"Strategy({what}=): the model has no module {pattern!r}{hint}")
            found += hits
    found = list({id(m): (p, m) for p, m in found}.values())
    return [(p, m) for p, m in found if not any(p.startswith(q + ".") for q, _ in found)]


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks: the children holding parameters of its first
    ``nn.Sequential`` / ``nn.ModuleList`` (the root itself when it is one)."""
    for path, module in model.named_modules():
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            prefix = f"{path}." if path else ""
            return [(f"{prefix}{name}", child) for name, child in module.named_children()
                    if any(True for _ in child.parameters())]
    return []


DEFAULT = Strategy()
