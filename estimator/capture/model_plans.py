"""The parallel plans a model carries, applied by its library's own code.

A transformers model names how it splits: ``config.base_model_tp_plan`` (tensor parallelism, what
``from_pretrained(tp_plan="auto")`` applies) and ``base_model_fsdp_plan`` (which modules FSDP2
shards, which keep their full weights).  ``from_pretrained(distributed_config=...)`` lays the ranks
out as a dense mesh ``(pp, dp_replicate, fsdp, tp)`` and an expert mesh ``(pp, dp_replicate,
efsdp, ep)`` (``transformers.distributed.utils.initialize_distributed_mesh``) and calls
``maybe_distribute_model`` (``transformers/distributed/mixin.py``): tensor parallelism, then
FSDP2.  ``own_plans`` is that call, as a parallelize function: ``Strategy(mesh={"dp_shard": 4,
"tp": 2}, parallelize=own_plans)``; ``compare`` and ``plan`` propose it for a number of devices
(``mesh_strategies``).  The mesh's dims are torchtitan's names or transformers' own:
``dp_replicate`` (HSDP's replicas), ``dp_shard`` or ``fsdp``, ``tp``; expert parallelism regroups those
ranks (``own_plans(..., ep=)``; ``mesh_strategies`` offers it for a model with an expert-parallel
plan).  Pipeline parallelism is not offered (every dim but these is refused).
"""

from __future__ import annotations

import functools
import math
import re

from torch import nn

from estimator.vocab.errors import InputError

_DIMS = {"dp_replicate": "dp_replicate", "dp_shard": "fsdp", "fsdp": "fsdp", "tp": "tp"}
TP_SIZES = (2, 4, 8)  # what mesh_strategies tries: tensor parallelism stays within a node


def carries_plans(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model with a tensor-parallel plan."""
    config = getattr(model, "config", None)
    return callable(getattr(type(model), "maybe_distribute_model", None)) and \
        bool(getattr(config, "base_model_tp_plan", None))


def own_plans(model: nn.Module, mesh, ep: int = 1) -> None:
    """Tensor parallelism and FSDP2 by the model's own plans, through transformers'
    ``maybe_distribute_model`` on the meshes its ``initialize_distributed_mesh`` builds from
    ``mesh``'s sizes (see the module); ``ep``: an MoE's experts split over that many of the
    FSDP x TP ranks (``DistributedConfig(ep_size=)``: its all-to-all token dispatch, ``functools.partial(
    own_plans, ep=2)``)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not callable(getattr(type(model), "maybe_distribute_model", None)):
        raise InputError(f"own_plans: {type(model).__name__} carries no parallel plans (a transformers model does: "
                         "config.base_model_tp_plan); pass a parallelize function of your own")
    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.distributed.utils import TransformersDeviceMesh

    names = mesh.mesh_dim_names or ()
    unknown = [n for n in names if n not in _DIMS]
    if unknown:
        raise InputError(f"own_plans: mesh dim(s) {', '.join(map(repr, unknown))} are not among the model's plans "
                         f"(its dims: {', '.join(map(repr, _DIMS))})")
    sizes = {"dp_replicate": 1, "fsdp": 1, "tp": 1}
    for name, size in zip(names, mesh.mesh.shape):
        sizes[_DIMS[name]] *= int(size)
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1 or (sizes["fsdp"] * sizes["tp"]) % ep:
        raise InputError(f"own_plans: ep={ep!r} must be a whole number that divides the FSDP x TP ranks "
                         f"({sizes['fsdp']} x {sizes['tp']})")
    config = DistributedConfig(tp_size=sizes["tp"], fsdp_size=sizes["fsdp"],
                               dp_replicate_size=sizes["dp_replicate"], ep_size=ep)
    dense = init_device_mesh("cpu", (1, sizes["dp_replicate"], sizes["fsdp"], sizes["tp"]),
                             mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
    expert = init_device_mesh("cpu", (1, sizes["dp_replicate"], config.efsdp_size, config.ep_size),
                              mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
    type(model).maybe_distribute_model(model, config, TransformersDeviceMesh(dense, expert))


def tp_sizes(model: nn.Module, devices: int) -> list[int]:
    """The tensor-parallel sizes of ``TP_SIZES`` that divide ``devices`` and the model's heads
    (query and key/value heads are split over the ranks); none where its config does not say
    how many heads it has (a multimodal model's text config: not offered rather than guessed)."""
    config = getattr(model, "config", None)
    heads = [getattr(config, name, None) for name in ("num_attention_heads", "num_key_value_heads")]
    heads = [h for h in heads if isinstance(h, int)]
    return [t for t in TP_SIZES if heads and devices % t == 0 and all(h % t == 0 for h in heads)]


def experts(model: nn.Module) -> tuple[int, int]:
    """(how many experts, the bytes of the trainable expert weights) by the model's expert-parallel
    plan (transformers' ``model.ep_plan``: the weights ``MoEParamShard`` splits along dim 0, the
    experts'); (0, 0) where it has none."""
    patterns = [re.compile(re.escape(k).replace(r"\*", r"\d+") + "$") for k in getattr(model, "ep_plan", None) or {}]
    found = [t for name, t in model.named_parameters() if any(p.match(name) for p in patterns)]
    if not found:
        return 0, 0
    return found[0].shape[0], sum(t.numel() * t.element_size() for t in found if t.requires_grad)


def ep_size(model: nn.Module, devices: int) -> int:
    """The expert-parallel size ``mesh_strategies`` offers: the experts over as many of the
    ``devices`` as divide both (1: none)."""
    count, _ = experts(model)
    return math.gcd(count, devices) if count else 1


def ep_of(parallelize) -> int:
    """The ``ep`` a parallelize function applies: ``own_plans``' (``functools.partial(own_plans,
    ep=...)``), else 1."""
    if isinstance(parallelize, functools.partial) and parallelize.func is own_plans:
        return parallelize.keywords.get("ep", 1)
    return 1


def mesh_for(devices: int, tp: int) -> dict[str, int]:
    """``devices`` ranks as FSDP over ``devices / tp`` times tensor parallelism over ``tp``."""
    shard = devices // tp
    return {**({"dp_shard": shard} if shard > 1 else {}), **({"tp": tp} if tp > 1 else {})}
