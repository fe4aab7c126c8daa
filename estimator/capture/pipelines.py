"""A job's own pipeline schedule: ``torch.distributed.pipelining`` run as written, each rank's
stages on the fake process group.

``Strategy(mesh={"pp": 2, "dp_shard": 2}, parallelize=fn)`` where ``fn(model, mesh)`` cuts the model
in place to this rank's stage (the modules of the other stages deleted), wraps it as the job
does (``fully_shard``, ``replicate``, ``parallelize_module``), builds its ``PipelineStage`` and
returns the schedule (``ScheduleGPipe(stage, n_microbatches, loss_fn=...)``, ...).  The step
(``step``, the real job's too) is torchtitan's: ``schedule.step(inputs, target=, losses=)``,
the inputs given to the first stage, the target to the last, then the optimizer over the stage's
parameters.  The schedule's forwards, backwards, sends and receives, FSDP2's or DDP's hooks in
them, run as written; what another rank would answer, the capture answers (``answered``):

- The warm-up vote (``schedules.py`` ``_warmup_p2p``: the product of every stage's vote, 1 for a
  stage whose shapes were given, ``PipelineStage(input_args=, output_args=)``): every stage
  votes as this one (they run the job's same code).
- Given shapes (static mode): the schedule splits the batch along dim 0 into ``n_microbatches``
  chunks (its default ``TensorChunkSpec(0)``), so the stage's given shapes describe one
  micro-batch: their dim 0 becomes the micro-batch of the estimated batch (a symbol in a symbolic
  capture), so one capture answers every batch.
- Inferred shapes (dynamic mode, torchtitan's): a later stage receives the earlier stage's output
  metadata (``_recv_meta``).  Its capture stops at the vote (``NeedsInputs``) and
  ``input_shapes`` runs the earlier stages' forwards first, each on the rank that holds it, at three
  micro-batch sizes (each size and stride then ``a * rows + c``: ``Affine``); the capture answers
  ``_recv_meta`` with them, and the gradient the next stage sends back as ``_derive_grad_metas`` of
  the stage's outputs (static mode's derivation); ``_send_meta`` sends nothing.
- The sends: gloo's send and receive works hold their tensor until the work is dropped
  (``ProcessGroupGloo.cpp`` ``SendWork`` / ``RecvWork``: ``tensor_``); the fake process group's
  hold nothing, so the capture's works do (``_Held``); a batch of them runs op by op, as
  ``batch_isend_irecv`` does for a backend without coalescing (gloo).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten

from estimator.corrections.patches import patched
from estimator.vocab.errors import FxmemError, InputError

__all__ = ["NeedsInputs", "Pipelined", "answered", "buffers", "check", "input_shapes", "is_schedule", "micro_rows",
           "notes", "positions", "split_sample", "stages", "step"]


def is_schedule(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.pipelining`` schedule."""
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    return isinstance(value, _PipelineSchedule)


def stages(schedule) -> list:
    """The schedule's stages on this rank (one for ``PipelineScheduleSingle``)."""
    many = getattr(schedule, "_stages", None)
    return list(many) if many is not None else [schedule._stage]


def split_sample(sample: Any) -> tuple[tuple, Any]:
    """``(inputs, target)`` of a pipeline's sample: ``(input, target)`` (the input a tensor or a tuple
    of them) or a dict with ``labels`` (the other entries the inputs, in order)."""
    if isinstance(sample, Mapping) and "labels" in sample:
        return tuple(v for k, v in sample.items() if k != "labels"), sample["labels"]
    if isinstance(sample, (tuple, list)) and len(sample) == 2 and isinstance(sample[1], torch.Tensor):
        inputs = sample[0]
        return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), sample[1]
    raise InputError(f"a pipeline's sample is (input, target) or a dict with 'labels' (torchtitan's inputs and "
                     f"labels): the first stage gets the input, the last the target; got {type(sample).__name__}")


def step(schedule, sample: Any, optimizer) -> tuple[Any, list]:
    """One training step of the pipeline, as torchtitan's ``train_step`` runs it:
    ``schedule.step(*inputs, target=, losses=)`` (the inputs on the first stage, the target and
    the losses on the last), then ``optimizer.step()`` and ``zero_grad(set_to_none=True)``.
    Returns the last stage's merged output (None elsewhere) and its losses."""
    inputs, target = split_sample(sample)
    own = stages(schedule)
    first, last = any(s.is_first for s in own), any(s.is_last for s in own)
    losses: list = []
    out = schedule.step(*(inputs if first else ()), target=target if last else None,
                        losses=losses if last else None)
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out, losses


@dataclasses.dataclass(frozen=True)
class Pipelined:
    """The built-in step of a job whose parallelize function returned its pipeline schedule:
    ``step``, called as a user's step ``(model, sample, optimizer)``."""

    schedule: Any

    def __call__(self, model: nn.Module, sample: Any, state: Any = None) -> Any:
        return step(self.schedule, sample, state)

    def __str__(self) -> str:
        return f"pipeline step ({type(self.schedule).__name__})"


def check(schedule, model: nn.Module, train: bool) -> None:
    """The schedule runs the model the capture estimates: each stage's module is the model or one of
    its modules, every parameter of the model is in a stage (the others' were deleted), and the
    batch is chunked along dim 0."""
    if not train:
        raise InputError("Strategy(parallelize=) returned a pipeline schedule: fxmem runs it for mode='train' "
                         "(schedule.step with its loss_fn); inference through a pipeline is not supported")
    if getattr(schedule, "_loss_fn", None) is None:
        raise InputError("Strategy(parallelize=) returned a pipeline schedule without loss_fn: a training step's "
                         "last stage computes the loss (ScheduleGPipe(stage, n_microbatches, loss_fn=...))")
    specs = [*tree_flatten(getattr(schedule, "_args_chunk_spec", None))[0],
             *tree_flatten(getattr(schedule, "_kwargs_chunk_spec", None))[0]]
    if any(getattr(spec, "split_dim", 0) != 0 for spec in specs):
        raise InputError("your pipeline schedule splits its inputs into micro-batches along another dim than 0 "
                         "(args_chunk_spec / kwargs_chunk_spec): fxmem sizes the stages' micro-batches along dim 0, "
                         "the schedule's default")
    modules = {id(m) for m in model.modules()}
    own = stages(schedule)
    if any(id(s.submod) not in modules for s in own):
        raise InputError("Strategy(parallelize=) returned a pipeline schedule whose stage module is not the model "
                         "or one of its modules: cut the model in place to this rank's stage (delete the other "
                         "stages' modules, as torchtitan's pipeline split does on its copy) and build the stage on it")
    staged = {id(p) for s in own for p in s.submod.parameters()}
    outside = [name for name, p in model.named_parameters() if id(p) not in staged]
    if outside:
        raise InputError(f"Strategy(parallelize=) left {len(outside)} parameters outside this rank's pipeline stages "
                         f"({', '.join(outside[:3])}{', ...' if len(outside) > 3 else ''}): delete the modules of the "
                         "other stages from the model, as the rank's real job holds only its own")


def positions(schedule, device_mesh, world: int) -> list[int]:
    """Each rank's place in its pipeline: its coordinate along the mesh dim whose process group is
    the stages' (``PipelineStage(group=)``; the default group: the rank itself)."""
    import torch.distributed as dist

    from estimator.capture.world import _mesh_coordinates

    group = stages(schedule)[0].group
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(world))
    if len(ranks) == world:
        return list(range(world))
    for d in range(device_mesh.ndim):
        if tuple(dist.get_process_group_ranks(device_mesh.get_group(d))) == ranks:
            return [coordinate[d] for coordinate in _mesh_coordinates(device_mesh, world)]
    raise InputError(f"the pipeline stages' process group (ranks {list(ranks)}) is no dim of the device mesh: build "
                     "the stages with group=mesh['pp'].get_group() (a dim of the mesh fxmem hands your function)")


def notes(schedule) -> tuple[str, ...]:
    """What the report of a job's pipeline says about it."""
    from torch.distributed.pipelining._utils import InferenceMode

    m = schedule._n_microbatches
    if all(getattr(s, "_inference_mode", None) is InferenceMode.DYNAMIC for s in stages(schedule)):
        shapes = ("the stages infer their shapes in their first step (dynamic mode): what a later stage receives is "
                  "the earlier stages' output, found by running their forwards first, each on the rank that holds it")
    else:
        shapes = ("the stages' given shapes (input_args, output_args: one micro-batch) are taken at each batch's "
                  "micro-batch (dim 0, the schedule's chunking dim)")
    return (f"your pipeline schedule ({type(schedule).__name__}) runs {m} micro-batches of b/{m} per step (b must be a "
            f"multiple of {m}), as written, on this rank's stages; {shapes}; each send and receive holds its tensor "
            "until the schedule drops its work, as gloo's do",)


def buffers(schedule) -> dict[str, torch.Tensor]:
    """The receive buffers the stages made in their first step and keep (``stage.py``
    ``_setup_forward_recv_info`` / ``_create_grad_recv_info``: one per micro-batch and input, and
    per output's gradient), by name."""
    found = {}
    for s in stages(schedule):
        for kind in ("args_recv_info", "grad_recv_info"):
            for chunk, infos in getattr(s, kind, {}).items():
                for i, info in enumerate(infos):
                    if isinstance(getattr(info, "buffer", None), torch.Tensor):
                        found[f"stage {s.stage_index} {kind.split('_')[0]} receive buffer {chunk}.{i}"] = info.buffer
    return found


class _Held:
    """A point-to-point work that holds its tensor while it lives, as gloo's do."""

    def __init__(self, work, tensor: torch.Tensor):
        self._work, self._tensor = work, tensor

    def __getattr__(self, name: str):
        return getattr(self._work, name)


class NeedsInputs(FxmemError):
    """Later stages in the dynamic mode: what each receives is the previous stage's output
    (``input_shapes``), which the capture of their rank finds before it starts."""

    def __init__(self, stages_: tuple[int, ...], owners: dict[int, int]):
        super().__init__(f"pipeline stages {stages_} need the shapes of the earlier stages' outputs")
        self.stages, self.owners = stages_, owners  # owners: each stage's rank (global)


@dataclasses.dataclass(frozen=True)
class Affine:
    """A stage input's metadata at any micro-batch: each of its sizes and strides ``a * rows + c``."""

    meta: Any  # at ``rows`` = 0 (the metadata class and its other fields)
    slopes: dict[str, tuple[int, ...]]

    def at(self, rows):
        return dataclasses.replace(self.meta, **{
            name: type(getattr(self.meta, name))(a * rows + c for a, c in zip(slope, getattr(self.meta, name)))
            for name, slope in self.slopes.items()})


_SIZES = ("shape", "stride", "global_shape", "global_stride")
_ROWS = (4, 5, 6)  # the micro-batch rows of the forwards each size is solved from (consecutive: steps of 1)


def input_shapes(model: nn.Module, sample: Any, strategy, needs: NeedsInputs,
                 target) -> dict[int, tuple[Affine, ...]]:
    """What each stage of ``needs.stages`` receives, at any micro-batch: the forwards of the stages
    before it, each run as the rank that holds it (``world.joined``: the job's function cutting its
    own fake copy of the model, ``fake.fake_model``), the first on the sample's first micro-batch,
    each later one on the previous one's output, at three micro-batch sizes: every size and stride of
    what they pass on is then ``a * rows + c`` (dim 0 the rows, a flattened ``rows * s``, ...),
    checked."""
    from torch.distributed.pipelining._utils import extract_tensor_metas, validate_and_normalize_to_tuple

    from estimator import corrections
    from estimator.capture import world
    from estimator.capture.fake import fake_model, fake_sample

    found: dict[int, list] = {index: [] for index in needs.stages}
    for rows in _ROWS:
        metas = None
        for index in range(max(needs.stages)):
            mode = FakeTensorMode()
            with world.joined(strategy.mesh, needs.owners[index]) as device_mesh:
                fmodel = fake_model(model, mode)
                corrections.apply_model_rules(target, fmodel)
                schedule = world.parallelize(strategy.parallelize, fmodel, device_mesh)
                own = [s for s in stages(schedule) if s.stage_index == index] if is_schedule(schedule) else []
                if not own:
                    raise InputError(f"Strategy(parallelize=) on rank {needs.owners[index]} built no pipeline stage "
                                     f"{index}, which the schedule places there")
                with mode, torch.enable_grad():
                    if index == 0:
                        m = schedule._n_microbatches
                        inputs, _ = split_sample(fake_sample(sample, mode, rows * m, False))
                        args = tuple(torch.tensor_split(t, m)[0] for t in inputs)
                    else:
                        args = tuple(meta.to_tensor("cpu") for meta in metas)
                    out = own[0].submod(*args)
                metas = extract_tensor_metas(validate_and_normalize_to_tuple(out))
            if index + 1 in found:
                found[index + 1].append(metas)
    return {index: tuple(_affine(*each) for each in zip(*runs)) for index, runs in found.items()}


def _affine(*metas) -> Affine:
    """The metadata of one input at ``_ROWS`` as ``Affine``; a size that is not affine in the rows
    (its steps between consecutive row counts differ) is refused."""
    slopes, at0 = {}, {}
    for name in _SIZES:
        if not hasattr(metas[0], name):
            continue
        sizes = [tuple(getattr(m, name)) for m in metas]
        steps = {tuple(y - x for x, y in zip(low, high)) for low, high in zip(sizes, sizes[1:])}
        if len({len(v) for v in sizes}) > 1 or len(steps) > 1:
            raise InputError(f"a pipeline stage's output {name} does not grow linearly with the micro-batch "
                             f"({', '.join(map(str, sizes))} at {', '.join(map(str, _ROWS))} rows): give the stages "
                             "their shapes (PipelineStage input_args=, output_args=)")
        slopes[name] = steps.pop()
        at0[name] = type(getattr(metas[0], name))(x - a * _ROWS[0] for x, a in zip(sizes[0], slopes[name]))
    return Affine(dataclasses.replace(metas[0], **at0), slopes)


@contextlib.contextmanager
def answered(schedule, rows, inputs: dict[int, tuple[Affine, ...]] | None = None) -> Iterator[None]:
    """While the capture runs ``schedule``: what the other ranks would answer (module docstring);
    ``rows``: the micro-batch's rows (dim 0 of the schedule's chunks); ``inputs``: what this rank's
    later stages receive in the dynamic mode, by stage (``input_shapes``; None: raise ``NeedsInputs``
    for them)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._utils import (
        InferenceMode,
        _derive_grad_metas,
        _StageBackwardMeta,
        _StageForwardMeta,
    )
    from torch.distributed.pipelining.stage import PipelineStage

    vote = schedules._PipelineSchedule._warmup_p2p

    def warmup_p2p(self, stages_, has_backward, p2p_done):
        if not all(isinstance(s, PipelineStage) for s in stages_):
            return vote(self, stages_, has_backward, p2p_done)
        for s in stages_:
            if not InferenceMode.needs_dynamic(s._user_meta, has_backward):
                s._user_meta, s._inference_mode = _resized(s._user_meta, rows), InferenceMode.STATIC
                continue
            s._inference_mode = InferenceMode.DYNAMIC
        later = tuple(s.stage_index for s in stages_
                      if s._inference_mode is InferenceMode.DYNAMIC and not s.is_first)
        if later and inputs is None:
            group = stages_[0].group
            ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
            owners = {index: list(ranks)[place] for index, place in stages_[0].stage_index_to_group_rank.items()}
            raise NeedsInputs(later, owners)

    def recv_meta(self, src_stage):
        if src_stage < self.stage_index:
            return _StageForwardMeta(forward_metas=tuple(shape.at(rows) for shape in inputs[self.stage_index]))
        return _StageBackwardMeta(backward_metas=_derive_grad_metas(self._stage_meta.outputs))

    isend, irecv = (held(op) for op in (c10d.isend, c10d.irecv))

    def batch_isend_irecv(ops):  # gloo's way: each op on its own (no coalescing)
        return [op.op(op.tensor, group=op.group, tag=op.tag,
                      **{"group_dst" if op.op is isend else "group_src": op.group_peer}) for op in ops]

    with patched(schedules._PipelineSchedule, "_warmup_p2p", warmup_p2p), \
            patched(PipelineStage, "_recv_meta", recv_meta), \
            patched(PipelineStage, "_send_meta", lambda self, meta, dst_stage: None), \
            patched(vars(c10d), "isend", isend), patched(vars(c10d), "irecv", irecv), \
            patched(vars(dist), "isend", isend), patched(vars(dist), "irecv", irecv), \
            patched(vars(c10d), "batch_isend_irecv", batch_isend_irecv), \
            patched(vars(dist), "batch_isend_irecv", batch_isend_irecv):
        yield


def held(op):
    """``op`` (``isend`` / ``irecv``) whose work holds its tensor (``_Held``)."""
    def call(tensor, *args, **kwargs):
        return _Held(op(tensor, *args, **kwargs), tensor)
    return call


def _resized(meta, rows):
    """The stage's given shapes with dim 0 the micro-batch's rows."""
    def one(m):
        if m is None or not m.shape:
            return m
        sizes = {"shape": torch.Size([rows, *m.shape[1:]])}
        if getattr(m, "global_shape", None):
            sizes["global_shape"] = torch.Size([rows, *m.global_shape[1:]])
        return dataclasses.replace(m, **sizes)

    return dataclasses.replace(meta, **{name: None if value is None else tuple(one(m) for m in value)
                                        for name in ("inputs", "outputs", "input_grads", "output_grads")
                                        for value in [getattr(meta, name)]})


def micro_rows(schedule, sample: Any):
    """The rows of the schedule's first micro-batch: ``torch.tensor_split`` of the sample's first
    tensor along dim 0, as the schedule splits it."""
    tensors = [t for t in tree_flatten(split_sample(sample))[0] if isinstance(t, torch.Tensor)]
    return torch.tensor_split(tensors[0], schedule._n_microbatches)[0].shape[0]
