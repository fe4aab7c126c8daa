"""lit-gpt as its resource tables ran it, for the published rows of ``validators/published_data.py``:
its own GPT with LoRA on query and value, a LoRA fine-tuning iteration of ``finetune/lora.py``,
under Lightning Fabric's ``bf16-true`` precision.

Which code: the table (tutorials/resource-tables.md) names "Lit-GPT commit 8641822" (2023-10-16)
as its environment and was merged by its own PR #663 (0cc02afa, 2023-10-27); between them PR
#606 (6178c7cc, 2023-10-24, "Half precision fixes") made ``RMSNorm`` compute in fp32 and reordered
the residual sums.  The Llama 2 rows (the only RMSNorm models) fit the code with #606: with
8641822's bf16 ``RMSNorm`` they come out 3-5 % under the table, with #606's within 0.2 %, so the
runs had it.  This module follows lit-gpt at 0cc02afa (``RMSNorm.upcast = False``: 8641822's).
For phi-1.5 and StableLM (LayerNorm) the two commits differ only in the residual sums' order.

Written to follow the sources, not copied from them; each choice names the file and lines of
Lightning-AI/lit-gpt at 0cc02afa (``git show 0cc02afa:<file>``) or of Lightning 2.1's
``lightning/fabric/plugins/precision/half.py`` (``HalfPrecision``).  What matters for memory,
and what a transformers model with a LoRA per projection (the earlier stand-in) does not do:

- the query/key/value projection is one fused ``LoRAQKVLinear`` (lora.py 153-386): one LoRA
  dropout of ``x``, ``conv1d`` of the rank-``2r`` update (lora.py 298-331), and ``zero_pad``
  (lora.py 256-296), whose ``index_copy`` scatters the update into a zero ``(B·T, 3·C)`` tensor
  and keeps its index for backward;
- ``q``, ``k`` and ``v`` stay views of that fused output (model.py 192-212: ``view``,
  ``permute``, ``split``, ``reshape`` merging a size-1 dim), so attention, which saves ``v``,
  keeps all of ``qkv``;
- rotary embeddings multiply the bf16 ``q``/``k`` by the fp32 ``cos``/``sin`` cache (model.py
  292-310; rebuilt at the longest sample by finetune/lora.py 176) and cast back (model.py
  313-319);
- Fabric's ``convert_output`` casts the LM head's chunks to the default dtype, fp32 (half.py),
  so the cross entropy runs on fp32 logits, which the iteration's ``logits`` list keeps alive
  through ``backward`` (finetune/lora.py 216-220).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Config:
    """lit_gpt/config.py 14-86 (the fields that change memory) and the named entries below."""

    n_embd: int
    n_head: int
    n_layer: int
    padded_vocab_size: int
    intermediate_size: int
    rotary_percentage: float
    parallel_residual: bool = True
    shared_attention_norm: bool = False
    bias: bool = True
    lm_head_bias: bool = False
    norm: str = "LayerNorm"  # or "RMSNorm"
    mlp: str = "GptNeoxMLP"  # or "LLaMAMLP"
    gelu_approximate: str = "none"
    norm_eps: float = 1e-5

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def rope_n_elem(self) -> int:
        return int(self.rotary_percentage * self.head_size)


CONFIGS = {
    # config.py 1097-1111: phi-1_5 (vocab 50257 padded to 51200; n_head 32 and 4 x n_embd MLP by default)
    "phi-1_5": Config(n_embd=2048, n_head=32, n_layer=24, padded_vocab_size=51200, intermediate_size=8192,
                      rotary_percentage=0.5, shared_attention_norm=True, lm_head_bias=True, gelu_approximate="tanh"),
    # config.py 136-139 + the defaults of 14-56: stablelm-base-alpha-3b (vocab 50254 padded to a multiple of 512)
    "stablelm-base-alpha-3b": Config(n_embd=4096, n_head=32, n_layer=16, padded_vocab_size=50688,
                                     intermediate_size=16384, rotary_percentage=0.25),
    # config.py 648-677: Llama-2-7b-hf and Llama-2-13b-hf (vocab 32000, a multiple of 64)
    "Llama-2-7b-hf": Config(n_embd=4096, n_head=32, n_layer=32, padded_vocab_size=32000, intermediate_size=11008,
                            rotary_percentage=1.0, parallel_residual=False, bias=False, norm="RMSNorm",
                            mlp="LLaMAMLP"),
    "Llama-2-13b-hf": Config(n_embd=5120, n_head=40, n_layer=40, padded_vocab_size=32000, intermediate_size=13824,
                             rotary_percentage=1.0, parallel_residual=False, bias=False, norm="RMSNorm",
                             mlp="LLaMAMLP"),
}


class RMSNorm(nn.Module):
    """rmsnorm.py 17-23: in fp32, the result cast back (PR #606); with ``upcast = False``
    8641822's, in the input's dtype."""

    upcast = True

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.upcast:
            x = x.float()
        norm_x = torch.mean(x * x, dim=-1, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        return (self.weight * x_normed).to(dtype=dtype) if self.upcast else self.weight * x_normed


def _norm(config: Config) -> nn.Module:
    """config.py ``norm_class``: torch's LayerNorm or lit-gpt's RMSNorm."""
    if config.norm == "RMSNorm":
        return RMSNorm(config.n_embd, config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps)


class LoRAQKVLinear(nn.Module):
    """lora.py 153-386 with ``enable_lora = (True, False, True)`` (finetune/lora.py 49-51: query and
    value), MHA (``n_query_groups == n_head`` in every model here)."""

    def __init__(self, config: Config, r: int, alpha: int, dropout: float):
        super().__init__()
        c = config.n_embd
        self.linear = nn.Linear(c, 3 * c, bias=config.bias)
        self.lora_A = nn.Parameter(torch.zeros(2 * r, c))  # lora.py 208: r * sum(enable_lora) rows
        self.lora_B = nn.Parameter(torch.zeros(2 * c, r))  # lora.py 218: the query and value widths
        self.lora_dropout = nn.Dropout(dropout)
        self.scaling = alpha / r
        # lora.py 247-254: the query's and the value's columns of the fused output
        self.lora_ind = [*range(c), *range(2 * c, 3 * c)]

    def zero_pad(self, x: torch.Tensor) -> torch.Tensor:
        """lora.py 284-296."""
        x = x.transpose(0, 1)
        out = self.linear.out_features
        result = x.new_zeros((*x.shape[:-1], out)).view(-1, out)
        result = result.index_copy(1, torch.tensor(self.lora_ind, device=result.device), x.reshape(-1, x.shape[-1]))
        return result.view((*x.shape[:-1], out)).transpose(0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """lora.py 351-386; ``conv1d`` with ``groups=2`` (lora.py 319-320, n_head == n_query_groups)."""
        pretrained = self.linear(x)
        after_a = F.linear(self.lora_dropout(x), self.lora_A)
        after_b = F.conv1d(after_a.transpose(-2, -1), self.lora_B.unsqueeze(-1), groups=2).transpose(-2, -1)
        return pretrained + self.zero_pad(after_b) * self.scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """model.py 313-319."""
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return ((x * cos) + (rotated * sin)).type_as(x)


class CausalSelfAttention(nn.Module):
    """model.py 169-238 (training: no KV cache, no mask; torch's SDPA, flash-attn dropped by
    PR #668)."""

    def __init__(self, config: Config, r: int, alpha: int, dropout: float):
        super().__init__()
        self.config = config
        self.attn = LoRAQKVLinear(config, r, alpha, dropout)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)  # lora.py 554-558: r = 0 (to_projection off)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        b, t, c = x.size()
        qkv = self.attn(x).view(b, t, cfg.n_head, 3, cfg.head_size).permute(0, 2, 3, 1, 4)
        q, k, v = qkv.split((1, 1, 1), dim=2)
        q, k, v = (y.reshape(b, -1, t, cfg.head_size) for y in (q, k, v))  # v: still a view of qkv
        n = cfg.rope_n_elem
        q = torch.cat((apply_rope(q[..., :n], cos, sin), q[..., n:]), dim=-1)
        k = torch.cat((apply_rope(k[..., :n], cos, sin), k[..., n:]), dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, scale=1.0 / math.sqrt(cfg.head_size),
                                           is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class GptNeoxMLP(nn.Module):
    """model.py 264-275."""

    def __init__(self, config: Config):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.approximate = config.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class LLaMAMLP(nn.Module):
    """model.py 278-289."""

    def __init__(self, config: Config):
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fc_1, x_fc_2 = self.fc_1(x), self.fc_2(x)
        return self.proj(F.silu(x_fc_1) * x_fc_2)


class Block(nn.Module):
    """model.py 135-166 (the residual sums in PR #606's order)."""

    def __init__(self, config: Config, r: int, alpha: int, dropout: float):
        super().__init__()
        self.config = config
        self.norm_1 = _norm(config)
        self.attn = CausalSelfAttention(config, r, alpha, dropout)
        self.norm_2 = None if config.shared_attention_norm else _norm(config)
        self.mlp = GptNeoxMLP(config) if config.mlp == "GptNeoxMLP" else LLaMAMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n_1 = self.norm_1(x)
        h = self.attn(n_1, cos, sin)
        if self.config.parallel_residual:
            n_2 = n_1 if self.config.shared_attention_norm else self.norm_2(x)
            return self.mlp(n_2) + h + x
        x = h + x
        return self.mlp(self.norm_2(x)) + x


class GPT(nn.Module):
    """lora.py 454-503 (the LM head a plain linear: ``to_head`` off) with the rope cache built at
    ``seq``, fp32 (finetune/lora.py 176; model.py 38-53, 96-103, 292-310)."""

    def __init__(self, config: Config, seq: int, r: int = 8, alpha: int = 16, dropout: float = 0.05):
        super().__init__()
        self.config = config
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=config.lm_head_bias)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
            h=nn.ModuleList(Block(config, r, alpha, dropout) for _ in range(config.n_layer)),
            ln_f=_norm(config),
        ))
        # (the values do not matter for memory: ones)
        self.register_buffer("cos", torch.ones(seq, config.rope_n_elem, dtype=torch.float32), persistent=False)
        self.register_buffer("sin", torch.ones(seq, config.rope_n_elem, dtype=torch.float32), persistent=False)

    def forward(self, idx: torch.Tensor, lm_head_chunk_size: int = 128) -> list[torch.Tensor]:
        t = idx.size(1)
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, cos, sin)
        x = self.transformer.ln_f(x)
        return [self.lm_head(x_i) for x_i in x.split(lm_head_chunk_size, dim=1)]


def build(config: str | Config, seq: int, device: str = "meta", quantize: str | None = None) -> GPT:
    """lit-gpt's LoRA GPT (``config``: a name of ``CONFIGS``) on ``device``, as ``finetune/lora.py``
    128-135 and Fabric's ``setup_module`` leave it: bf16 parameters
    (``HalfPrecision.convert_module``), only the LoRA matrices trainable
    (``mark_only_lora_as_trainable``, lora.py 389), the rope cache fp32 (set afterwards,
    finetune/lora.py 176).  ``quantize="nf4"`` (or ``"nf4-dq"``, ``"fp4"``, ``"fp4-dq"``): the
    script's ``--quantize bnb.<mode>`` (``quantize_linears``)."""
    with torch.device(device):
        model = GPT(CONFIGS[config] if isinstance(config, str) else config, seq)
    cos, sin = model.cos, model.sin
    model = model.to(torch.bfloat16)
    model.cos, model.sin = cos, sin
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return quantize_linears(model, quantize) if quantize else model


class _MatMul4Bit041(torch.autograd.Function):
    """bitsandbytes 0.41.1's ``MatMul4Bit`` (autograd/_functions.py 494-549; the table's version),
    dequantizing with the installed bitsandbytes' ``dequantize_4bit`` (an ``empty(shape, dtype)``
    of the weight's shape in its quantized dtype, as 0.41.1's): the weight dequantized, cast to the
    input's dtype and multiplied; ``ctx.tensors = (A, B)`` when an input needs a gradient, so the
    input ``A`` stays alive until backward (the installed 0.50.2 keeps ``(None, B)``); backward
    dequantizes again.  0.41.1's transposes (``B`` is ``weight.t()``; ``dequantize_4bit`` turns
    a transposed input's output back) are views.  A bias here is frozen (LoRA): no gradient."""

    @staticmethod
    def forward(ctx, A, B, state, bias):
        import bitsandbytes.functional as bnb_f

        output = F.linear(A, bnb_f.dequantize_4bit(B, state).to(A.dtype), bias)
        ctx.state = state
        ctx.tensors = (A, B) if any(ctx.needs_input_grad[:2]) else (None, None)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        import bitsandbytes.functional as bnb_f

        _, B = ctx.tensors
        grad_a = None
        if ctx.needs_input_grad[0]:
            grad_a = torch.matmul(grad_output, bnb_f.dequantize_4bit(B, ctx.state).to(grad_output.dtype))
        return grad_a, None, None, None


def _linear4bit_041():
    import bitsandbytes as bnb

    class Linear4bit041(bnb.nn.Linear4bit):
        """``bnb.nn.Linear4bit`` with bitsandbytes 0.41.1's forward (nn/modules.py 232-252): the input
        cast to the compute dtype (and the bias), ``matmul_4bit`` (autograd/_functions.py 566-579:
        ``MatMul4Bit`` for a training input), the output cast back."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            bias = None if self.bias is None else self.bias.to(self.compute_dtype)
            return _MatMul4Bit041.apply(x.to(self.compute_dtype), self.weight, self.weight.quant_state,
                                        bias).to(x.dtype)

    return Linear4bit041


def quantize_linears(model: nn.Module, mode: str) -> nn.Module:
    """finetune/lora.py 70-74 with ``--quantize bnb.<mode>``: Lightning 2.1's
    ``BitsandbytesPrecision(mode, bf16)`` (lightning/fabric/plugins/precision/bitsandbytes.py).
    Its ``module_init_context`` builds every ``torch.nn.Linear`` of the GPT (the LoRA layers' base
    linears and the LM head included: no ``ignore_modules``) as a ``bnb.nn.Linear4bit`` subclass
    (``_NF4Linear``: ``quant_type="nf4"``, ``compress_statistics=False``; ``-dq``: True), whose
    ``_quantize_weight`` casts the weight to fp16 and calls ``bnb.functional.quantize_4bit`` with
    the ``Params4bit``'s blocksize (64); ``convert_module`` sets the compute dtype (bf16).  Here
    each linear is replaced by that ``Linear4bit`` with an fp16 weight, quantized on its device by
    ``estimator.integrations.bitsandbytes.quantize`` (``Params4bit._quantize``: the same
    ``quantize_4bit`` call).  The LoRA matrices are ``nn.Parameter`` s, not linears: unquantized."""
    import bitsandbytes as bnb

    from estimator.integrations.bitsandbytes import quantize

    Linear4bit041 = _linear4bit_041()
    kind, _, double = mode.partition("-")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                weight = child.weight
                layer = Linear4bit041(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.bfloat16, compress_statistics=double == "dq",
                                      quant_type=kind, device=weight.device)
                layer.weight = bnb.nn.Params4bit(weight.detach().to(torch.float16), requires_grad=False,
                                                 blocksize=layer.weight.blocksize, compress_statistics=double == "dq",
                                                 quant_type=kind, module=layer)
                if child.bias is not None:
                    layer.bias = child.bias
                layer.compute_type_is_set = False
                setattr(parent, name, layer)
    return quantize(model)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Fabric's ``forward_context`` for ``bf16-true`` (half.py: ``_DtypeContextManager``)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def chunked_cross_entropy(logits: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """lit_gpt/utils.py 238-262 (a list of chunks, ``chunk_size`` 128)."""
    logit_chunks = [c.reshape(-1, c.size(-1)) for c in logits]
    target_chunks = [t.reshape(-1) for t in targets.split(logits[0].size(1), dim=1)]
    return torch.cat([F.cross_entropy(c, t, ignore_index=-1, reduction="none")
                      for c, t in zip(logit_chunks, target_chunks)]).mean()


def lora_step(accumulate: int):
    """One iteration of finetune/lora.py 216-224 through Fabric: the forward under the bf16
    default dtype, its output cast to fp32 (``HalfPrecision.convert_output``), the last chunk cut by
    a token, the chunked cross entropy, ``backward(loss / accumulate)``; then the optimizer step
    and ``zero_grad`` of an iteration that ends an accumulation (steady state: the LoRA matrices'
    AdamW state exists; the peak is the first, longest iteration's backward)."""

    def step(model: nn.Module, batch: dict[str, torch.Tensor], optimizer) -> None:
        input_ids, targets = batch["input_ids"], batch["labels"]
        with _default_dtype(torch.bfloat16):
            chunks = model(input_ids, lm_head_chunk_size=128)
        logits = [c.to(torch.get_default_dtype()) for c in chunks]
        del chunks  # (convert_output's input, a local of _FabricModule.forward)
        logits[-1] = logits[-1][..., :-1, :]
        loss = chunked_cross_entropy(logits, targets[..., 1:])
        (loss / accumulate).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """finetune/lora.py 143: AdamW over the trainable (LoRA) parameters."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4, weight_decay=0.01)


def paged_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """finetune/lora.py 138-141: with a ``BitsandbytesPrecision``, bitsandbytes' ``PagedAdamW`` over
    the trainable (LoRA) parameters."""
    import bitsandbytes as bnb

    return bnb.optim.PagedAdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4, weight_decay=0.01)
