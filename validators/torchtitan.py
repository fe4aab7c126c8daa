"""torchtitan as its end-of-2024 benchmark ran Llama 3.1 8B, for the published rows of
``validators/published_data.py`` (benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3).

Written to follow pytorch/torchtitan at 9dec370 (2024-12-26, the commit the benchmark names), not
copied from it; each piece names its file there (``git show 9dec370:<file>``):

- the model (torchtitan/models/llama/model.py, ``llama3_configs["8B"]`` in
  torchtitan/models/llama/__init__.py, ``vocab_size`` and ``max_seq_len`` set by train.py 106-107
  from the tiktoken tokenizer's 128,256 words and train_configs/llama3_8b.toml's ``seq_len``):
  fp32 parameters, rotary embeddings as complex64 products of fp32 copies of q and k,
  ``repeat_kv`` materialized, causal SDPA, the RMSNorm of torchtitan/models/norms.py (fp32 inside);
- its parallelize function (torchtitan/parallelisms/parallelize_llama.py ``apply_ac`` then
  ``apply_fsdp``): op-level selective activation checkpointing of each block with that commit's
  save list (``_save_list``: mm, flash / efficient SDPA, reduce_scatter, abs, max; every second mm
  recomputed), then FSDP2 of each block (``reshard_after_forward`` except the last block, which
  backward needs at once) and of the root, ``MixedPrecisionPolicy(bf16, fp32)`` (the job config's
  ``mixed_precision_param`` / ``_reduce`` defaults);
- one train step (train.py 266-323): ``zero_grad`` first, forward, the fp32 cross entropy of
  train.py's ``loss_fn``, ``del pred`` before backward, ``clip_grad_norm_`` (torchtitan/utils.py:
  ``get_total_norm`` and ``clip_grads_with_norm_``, foreach), the AdamW step (torchtitan/optimizer.py:
  foreach, betas (0.9, 0.95), weight decay 0.1).

And as its float8 pull request ran the 8B job (pytorch/torchtitan#808, merged as 069bae286,
2025-02-27; its model, step and SAC policy unchanged since 9dec370 but for names): with
``--training.compile`` (``apply_compile``, each block compiled after AC, before FSDP) and
``--model.converters float8`` (``convert_float8``, torchtitan/components/float8.py):
``parallelize_compiled``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models_zoo.llama import RMSNorm  # torchtitan/models/norms.py's: the same ops (fp32 inside)

VOCAB = 128_256  # the Llama 3 tiktoken tokenizer's n_words


@dataclass(frozen=True)
class ModelArgs:
    """torchtitan/models/llama/model.py ``ModelArgs``; the defaults are ``llama3_configs["8B"]``."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = VOCAB
    multiple_of: int = 1024
    ffn_dim_multiplier: float | None = 1.3
    norm_eps: float = 1e-5
    rope_theta: float = 500_000
    max_seq_len: int = 8192


def precompute_freqs_cis(dim: int, end: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    seqlen = xq_.shape[1]
    freqs_cis = freqs_cis[0:seqlen].view(1, seqlen, 1, xq_.shape[-1])  # reshape_for_broadcast
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return torch.unsqueeze(x, dim=3).expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(
        bs, slen, n_kv_heads * n_rep, head_dim)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_rep = args.n_heads // args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        output = F.scaled_dot_product_attention(xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                                is_causal=True)
        return self.wo(output.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int, ffn_dim_multiplier: float | None):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        if ffn_dim_multiplier is not None:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)  # 14,336 for 8B
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.multiple_of, args.ffn_dim_multiplier)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len,
                                                               args.rope_theta), persistent=True)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # a pipeline stage's chunk lacks the modules of the other stages (``pipeline``)
        h = self.tok_embeddings(tokens) if self.tok_embeddings else tokens
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        h = self.norm(h) if self.norm else h
        return self.output(h) if self.output else h


def build(args: ModelArgs = ModelArgs(), device: str = "meta") -> Transformer:
    """train.py 110-111: the model built on meta (fp32), parallelized before it is materialized."""
    with torch.device(device):
        return Transformer(args)


def sample(batch: int, seq_len: int = 8192, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """One batch of the data loader: ``input_ids`` and ``labels`` (the next tokens), int64."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    return {"input_ids": tokens[:, :-1].clone(), "labels": tokens[:, 1:].clone()}


# parallelize_llama.py ``_save_list`` at 9dec370 (the ops this torch lacks are skipped)
SAVE = ("aten.mm", "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_flash_attention",
        "_c10d_functional.reduce_scatter_tensor", "aten.abs", "aten.max")
# ... and at 069bae286 (models/llama/parallelize_llama.py): ``aten.abs`` no longer saved ("it's useful to
# always save the result of max"; with float8 linears every abs of a cast input or weight was kept)
SAVE_2025 = tuple(op for op in SAVE if op != "aten.abs")


def apply_ac(model: Transformer, save: tuple[str, ...] = SAVE) -> None:
    """parallelize_llama.py ``apply_ac`` with ``mode="selective"``, ``selective_ac_option="op"``: its
    policy (every second mm recomputed) as ``models_zoo.parallelize.apply_op_sac`` writes it."""
    from models_zoo.parallelize import apply_op_sac

    apply_op_sac(model, save)


def apply_fsdp(model: Transformer, mesh, pp_enabled: bool = False) -> None:
    """parallelize_llama.py ``apply_fsdp`` without CPU offload; under a pipeline (``pp_enabled``) no
    reshard after forward ("to avoid per-microbatch all-gathers")."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    config = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                               reduce_dtype=torch.float32)}
    for layer_id, block in model.layers.items():
        last = int(layer_id) == len(model.layers) - 1 if not pp_enabled else True
        fully_shard(block, **config, reshard_after_forward=not last)
    fully_shard(model, **config, reshard_after_forward=not pp_enabled)


def parallelize(model: Transformer, mesh) -> None:
    """``parallelize_llama`` for the benchmark's 1-D FSDP job: op-level SAC, then FSDP2 over ``mesh``
    (torchtitan's ``dp_shard`` dim)."""
    apply_ac(model)
    apply_fsdp(model, mesh)


def pipeline(model: Transformer, mesh, splits: tuple[str, ...] = ("layers.2",), microbatches: int | None = None):
    """The 2-D job ``{"pp": p, "dp_shard": d}`` as train.py at 9dec370 builds it: ``pipeline_llama``
    (torchtitan/parallelisms/pipeline_llama.py ``pipeline_llama_manual_split``: this rank's stage
    keeps the layers from its split point to the next, the first stage the embeddings, the last
    the norm and the output; a ``PipelineStage`` without shapes, which infers them in its first
    step), then ``parallelize_llama`` on the chunk (with a ``"tp"`` dim ``apply_tp``; op-level SAC,
    FSDP2 over ``dp_shard`` without reshard after forward), then ``build_pipeline_schedule``
    (pipelining_utils.py: the default ``1F1B``, ``pipeline_parallel_microbatches`` or the pp degree,
    train.py's ``loss_fn``).  torchtitan
    cuts a deep copy of the whole model on the meta device; here the model itself is cut (one stage
    per rank, as the "loop" style gives with as many stages as pp ranks), and the schedule returned."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    pp = mesh["pp"]
    stage, stages = pp.get_local_rank(), pp.size()
    if len(splits) != stages - 1:
        raise ValueError(f"{stages} stages need {stages - 1} split points, got {splits}")
    start = splits[stage - 1] if stage > 0 else None
    stop = splits[stage] if stage < stages - 1 else None
    if stage > 0:
        model.tok_embeddings = None
    drop = start is not None
    for name in list(model.layers.keys()):  # the contiguous layers from start (inclusive) to stop
        drop = False if f"layers.{name}" == start else True if f"layers.{name}" == stop else drop
        if drop:
            del model.layers[name]
    if stage < stages - 1:
        model.norm = None
        model.output = None
    pipeline_stage = PipelineStage(model, stage, stages, torch.device("cpu"), group=pp.get_group())
    if "tp" in mesh.mesh_dim_names:
        apply_tp(model, mesh["tp"])
    apply_ac(model)
    apply_fsdp(model, mesh["dp_shard"], pp_enabled=True)
    return Schedule1F1B(pipeline_stage, n_microbatches=microbatches or stages, loss_fn=loss_fn)


def apply_tp(model: Transformer, tp_mesh) -> None:
    """parallelize_llama.py ``apply_tp`` without float8 or async TP, and without loss parallelism
    (``--training.disable_loss_parallel``: the loss on replicated logits, so that the pipeline's
    built-in step needs no ``loss_parallel()`` context): the embedding row-wise, its output and the
    residual stream sharded along the sequence, the norms sequence-parallel, q/k/v and w1/w3
    column-wise, wo and w2 row-wise; a pipeline stage's chunk has the modules of its own stage only
    (``parallelize_module`` skips the others)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


def loss_fn(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """train.py's ``loss_fn``: the fp32 cross entropy of the flattened logits."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def apply_compile(model: Transformer) -> None:
    """parallelize_llama.py ``apply_compile`` (``--training.compile``): each block
    ``torch.compile(block, fullgraph=True)``, after AC and before FSDP (069bae286, as at 9dec370)."""
    for layer_id, block in model.layers.named_children():
        model.layers.register_module(layer_id, torch.compile(block, fullgraph=True))


def convert_float8(model: Transformer, recipe: str) -> None:
    """torchtitan/components/float8.py at 069bae286 (``--model.converters float8``), applied to the
    model before it is parallelized: every Linear but ``output`` a torchao ``Float8Linear``, by
    ``Float8LinearConfig.from_recipe_name(recipe)`` (``--float8.recipe_name rowwise``), or, for
    ``recipe="tensorwise-fsdp"``, the default tensorwise config with float8 all-gather
    (``--float8.enable_fsdp_float8_all_gather``; its scales precomputed after each optimizer
    step, ``train_step_precomputing``)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True) if recipe == "tensorwise-fsdp" \
        else Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn != "output")


def parallelize_compiled(model: Transformer, mesh, float8: str | None = None) -> None:
    """``parallelize_llama`` at 069bae286 for the 1-D FSDP job with ``--training.compile`` (and
    ``--model.converters float8`` where ``float8`` names its recipe): the converter, op-level SAC
    (that commit's save list, ``SAVE_2025``), the per-block compile, FSDP2."""
    if float8 is not None:
        convert_float8(model, float8)
    apply_ac(model, SAVE_2025)
    apply_compile(model)
    apply_fsdp(model, mesh)


def train_step_precomputing(model: nn.Module, batch: dict[str, torch.Tensor],
                            optimizer: torch.optim.Optimizer) -> None:
    """``train_step`` with the float8 converter's post-optimizer hook of 069bae286
    (``--float8.precompute_float8_dynamic_scale_for_fsdp``: torchao's
    ``precompute_float8_dynamic_scale_for_fsdp`` on the model after ``optimizer.step()``)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    train_step(model, batch, optimizer)
    precompute_float8_dynamic_scale_for_fsdp(model)


def optimizer(model: nn.Module | list) -> torch.optim.Optimizer:
    """torchtitan/optimizer.py ``build_optimizers`` with the 8B config (lr 3e-4, not fused), over the
    model's parameters (``report(step=)`` hands the model, the built-in step its parameters)."""
    params = model.parameters() if isinstance(model, nn.Module) else model
    return torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=False,
                             foreach=True)


def train_step(model: nn.Module, batch: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    """train.py 266-323 without pipeline or context parallelism (the LR scheduler allocates nothing)."""
    optimizer.zero_grad()
    pred = model(batch["input_ids"])
    loss = loss_fn(pred, batch["labels"])
    del pred  # "need to free to before bwd to avoid peaking memory"
    loss.backward()
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm(grads, 2.0, False, True)
    torch.nn.utils.clip_grads_with_norm_(params, 1.0, total_norm, True)
    optimizer.step()


TINY = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=32)


def tiny():
    """The same code at a size a CPU runs for real (``validators.strategies``' ``torchtitan`` model):
    ``(model, sample_fn, None)``, the loss is the step's own."""
    return build(TINY, device="cpu"), lambda batch: sample(batch, TINY.max_seq_len, TINY.vocab_size), None
