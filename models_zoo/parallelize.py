"""Parallelize functions as jobs write them, for ``Strategy(mesh=..., parallelize=fn)``.

Each is ``fn(model, mesh)``: it changes the model in place for the ``DeviceMesh`` it is handed,
the way torchtitan's ``parallelize_llama`` does (a pipeline's, ``sequential_pipeline``, cuts it to the
rank's stage and returns the stage's schedule), and runs unchanged in a real job (the
distributed validator runs the same functions on gloo: ``validators/distributed.py``,
strategy ``"mesh"``) and in fxmem's capture of each rank (on a fake process group).  Options are
keywords: bind them with ``functools.partial`` (which keeps the function picklable for the
validator's processes).  Copy one as a starting point for your own.
"""

from __future__ import annotations

import torch
from torch import nn

from estimator.vocab.strategy import blocks


def fsdp(model: nn.Module, mesh, *, reshard_after_forward: bool | int = True,
         param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
         offload_policy=None) -> None:
    """FSDP2 as torchtitan's ``apply_fsdp`` applies it: ``fully_shard`` each block (the children
    holding parameters of the model's first ``nn.Sequential`` / ``nn.ModuleList``), then the root,
    with a ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``.  A 1-D mesh shards over every rank
    (FSDP); a 2-D mesh ``{"dp_replicate": r, "dp_shard": s}`` replicates over its first dim and
    shards over its second (HSDP).  ``reshard_after_forward``: True (ZeRO-3), False (ZeRO-2) or an
    int, the size of the smaller group the parameters are resharded to after forward.
    ``offload_policy``: ``fully_shard``'s (``CPUOffloadPolicy()``: the shards in host memory)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward,
               "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
               "offload_policy": offload_policy or OffloadPolicy()}
    for _, block in blocks(model):
        fully_shard(block, **options)
    fully_shard(model, **options)


def llama_tp(model: nn.Module, mesh, *, sequence_parallel: bool = False, loss_parallel: bool = False) -> None:
    """Tensor parallelism for the zoo's Llama (``models_zoo.llama``) as PyTorch's TP tutorial and
    torchtitan's ``apply_tp`` write it, over the mesh's ``"tp"`` dim (its only dim if unnamed):
    attention's q/k/v and the SwiGLU's gate/up column-wise, their output projections row-wise,
    each block's heads divided among the ranks.  ``sequence_parallel``: the norms and the residual
    stream sharded along the sequence (``SequenceParallel``; ``PrepareModuleInput`` gathers the
    sequence before each projection).  ``loss_parallel``: the logits stay sharded over the
    vocabulary (a DTensor), for a loss under ``torch.distributed.tensor.parallel.loss_parallel()``;
    else every rank gathers the whole logits."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = mesh["tp"] if mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names else mesh
    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout between blocks
    logits = Shard(-1) if loss_parallel else Replicate()
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "output": ColwiseParallel(input_layouts=stream, output_layouts=logits, use_local_output=not loss_parallel),
        **({"norm": SequenceParallel()} if sequence_parallel else {}),
    })
    for block in model.layers:
        plan = {
            "attention": PrepareModuleInput(input_layouts=(stream, None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=stream),
            "feed_forward": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=stream),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sequence_parallel:
            plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
        parallelize_module(block, tp, plan)
        block.attention.n_heads //= tp.size()  # the heads this rank computes
        block.attention.n_kv_heads //= tp.size()


def llama_fsdp_tp(model: nn.Module, mesh, *, sequence_parallel: bool = True, op_sac: bool = False,
                  param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None) -> None:
    """2-D parallelism as torchtitan composes it on a mesh ``{"dp_shard": d, "tp": t}``: tensor
    parallelism within each ``tp`` group first (``llama_tp``), then, with ``op_sac``, torchtitan's
    op-level selective activation checkpointing of each block (``apply_op_sac``), then FSDP2 over
    ``dp_shard`` (``fsdp``) of the DTensor parameters it made."""
    llama_tp(model, mesh, sequence_parallel=sequence_parallel)
    if op_sac:
        apply_op_sac(model)
    fsdp(model, mesh["dp_shard"], param_dtype=param_dtype, reduce_dtype=reduce_dtype)


# torchtitan's op-level SAC (torchtitan/models/llama3/parallelize.py ``_op_sac_save_list``, applied by
# torchtitan/distributed/activation_checkpoint.py): the outputs of these ops are saved, every other op
# recomputed in backward, and of the matmuls only every second one is saved
_OP_SAC_SAVE = ("aten.mm", "aten._scaled_dot_product_efficient_attention",
                "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_cudnn_attention",
                "aten._scaled_dot_product_attention_math", "aten._scaled_dot_product_fused_attention_overrideable",
                "_c10d_functional.reduce_scatter_tensor", "aten.max", "torch_attn._varlen_attn")


def _op_sac_save_list(names: tuple[str, ...]) -> set:
    """The ops of ``names`` this torch has (and ``flex_attention``, a higher-order op)."""
    ops = set()
    for name in names:
        namespace, op = name.split(".")
        packet = getattr(getattr(torch.ops, namespace, None), op, None)
        if packet is not None:
            ops.add(packet.default)
    flex = getattr(torch._higher_order_ops, "flex_attention", None)
    return ops | ({flex} if flex is not None else set())


def apply_op_sac(model: nn.Module, save: tuple[str, ...] = _OP_SAC_SAVE) -> None:
    """Wrap each of ``model.layers`` in ``checkpoint_wrapper`` with torchtitan's op-level
    selective checkpointing policy (``create_selective_checkpoint_contexts``), as
    torchtitan's ``apply_ac(model, ac_config)`` with ``mode="selective", selective_ac_option="op"``
    does; ``save``: the names of the ops whose outputs are saved (torchtitan's current
    ``_op_sac_save_list`` by default; ``validators.torchtitan`` passes its 2024 commit's)."""
    from collections import defaultdict

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = _op_sac_save_list(save)

    def context_fn():
        meta = defaultdict(int)

        def policy(ctx, func, *args, **kwargs):
            mode = "recompute" if ctx.is_recompute else "forward"
            if func == torch.ops.aten.mm.default:
                meta[f"{mode}_mm_count"] += 1
            keep = func in save and not (func == torch.ops.aten.mm.default and meta[f"{mode}_mm_count"] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=False))


def loss_parallel_step(model: nn.Module, sample: dict, optimizer) -> None:
    """A training step whose cross-entropy runs on the vocabulary-sharded logits
    (``llama_tp(..., loss_parallel=True)``), as torchtitan's train step does: the loss and its
    backward inside ``torch.distributed.tensor.parallel.loss_parallel()``.  For
    ``report(step=loss_parallel_step, optimizer="adamw")``."""
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    ids = sample["input_ids"]
    logits = model(ids)
    with loss_parallel():
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(0, 1))
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def sequential_pipeline(model: nn.Module, mesh, *, rows: int | None = None, microbatches: int = 2,
                        schedule: str = "1f1b", split_points: tuple[int, ...] | None = None, loss: str = "mse",
                        reshard_after_forward: bool = False):
    """Pipeline parallelism for a model that runs one ``nn.Sequential`` (the model, or its first one),
    as torchtitan's ``pipeline_llama`` builds it, over the mesh's ``"pp"`` dim: this rank keeps its
    stage's children of the Sequential (the others deleted, in place), FSDP2 shards each of its
    ``nn.Linear`` and the stage over the mesh's ``"dp_shard"`` dim if it has one (torchtitan's
    ``reshard_after_forward=False`` under a pipeline), and it returns the schedule (``"gpipe"`` or
    ``"1f1b"``, ``microbatches`` per step, its loss ``"mse"`` or ``"cross_entropy"`` of the last
    stage's output and the target).  ``rows``: one micro-batch's rows, to give the stages their
    shapes (``PipelineStage(input_args=, output_args=)``, static mode); None: the stages infer them in
    the first step (dynamic mode, as torchtitan's).  ``split_points``: the child indices where stages
    2.. start (default: the Linear layers split evenly)."""
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    seq = next(m for m in model.modules() if isinstance(m, nn.Sequential))  # the model itself first
    pp = mesh["pp"]
    stage, stages = pp.get_local_rank(), pp.size()
    if split_points is None:
        linears = [i for i, child in enumerate(seq) if isinstance(child, nn.Linear)]
        split_points = tuple(linears[len(linears) * k // stages] for k in range(1, stages))
    bounds = (0, *split_points, len(seq))
    del seq[bounds[stage + 1]:]
    del seq[:bounds[stage]]
    linears = [child for child in seq if isinstance(child, nn.Linear)]
    if mesh.mesh_dim_names and "dp_shard" in mesh.mesh_dim_names:
        for linear in linears:
            fully_shard(linear, mesh=mesh["dp_shard"], reshard_after_forward=reshard_after_forward)
        fully_shard(seq, mesh=mesh["dp_shard"], reshard_after_forward=reshard_after_forward)
    shapes = {}
    if rows is not None:  # one micro-batch's input and output; a received activation requires grad
        shapes = {"input_args": (torch.empty(rows, linears[0].in_features, requires_grad=stage > 0),),
                  "output_args": (torch.empty(rows, linears[-1].out_features, requires_grad=True),)}
    pipeline_stage = PipelineStage(seq, stage, stages, torch.device("cpu"), group=pp.get_group(), **shapes)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    return kind(pipeline_stage, n_microbatches=microbatches,
                loss_fn={"mse": F.mse_loss, "cross_entropy": F.cross_entropy}[loss])
