"""One transformer layer's activations, fxmem's formula next to Korthikanti et al. 2022's table.

"Reducing Activation Recomputation in Large Transformer Models" (Korthikanti et al., 2022,
arXiv:2205.05198, §4 and Table 2) counts the bytes one GPT layer keeps for backward, with 16-bit
activations and 1-byte dropout masks, ``s`` tokens, batch ``b``, width ``h``, ``a`` heads:

- no parallelism: ``34·s·b·h + 5·a·s²·b``;
- tensor parallelism over ``t``: ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``;
- tensor and sequence parallelism: ``s·b·h·(34/t + 5·a·s/(h·t))``.

The layer here is the paper's (its §4.1): pre-LN, the attention's q/k/v and output projections,
softmax and dropout on the ``a·s²`` scores (no flash attention, no causal mask: Megatron fuses
scale, mask and softmax), a GeLU MLP of width ``4h``, dropout on both residual branches; fp16 on
the CUDA target.  Its parallel versions are Megatron's split as PyTorch writes it
(``parallelize_module``: q/k/v and the first MLP Linear column-wise, the projections row-wise,
``SequenceParallel`` on the norms and the dropouts' stream), each rank captured on a fake
process group (``Strategy(mesh=)``).  A stack of three layers is captured with ``b`` a symbol at
a few sequence lengths (``layer_bytes``), and the middle layer's activations are read from the
report's timeline (what its ops
allocate that stays for backward, as ``Report.modules`` counts them, in ``b`` and ``s``; the tensor
a layer hands the next is the giver's, as the paper's count of the first norm's input is).  The "today's kernels" column runs the same layer with
``scaled_dot_product_attention`` (flash attention on an H100).

    python -m validators.korthikanti [--markdown docs/korthikanti.md]
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass

import sympy
import torch
import torch.nn.functional as F
from torch import nn

import estimator
from estimator import Category, Poly, Strategy
from estimator.vocab.symbolic import B

H, A, P = 64, 4, 0.1  # width, heads, dropout: any sizes do (the coefficients are exact)
LAYERS, MIDDLE = 3, "layers.1"
b, s, h, a, t = sympy.symbols("b s h a t", positive=True)


class Attention(nn.Module):
    def __init__(self, flash: bool):
        super().__init__()
        self.heads, self.flash = A, flash  # heads: this rank's (``megatron`` divides them)
        self.q, self.k, self.v, self.proj = (nn.Linear(H, H) for _ in range(4))
        self.dropout = nn.Dropout(P)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        q, k, v = (f(y).view(y.shape[0], -1, self.heads, H // A).transpose(1, 2) for f in (self.q, self.k, self.v))
        if self.flash:
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=P if self.training else 0.0)
        else:
            scores = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.shape[-1]))
            o = self.dropout(torch.softmax(scores, dim=-1)) @ v
        return self.proj(o.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_1, self.fc_2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.fc_2(F.gelu(self.fc_1(y)))


class Layer(nn.Module):
    """Megatron's GPT layer as the paper counts it (``flash``: today's fused attention instead)."""

    def __init__(self, flash: bool = False):
        super().__init__()
        self.ln_1, self.attn, self.drop_1 = nn.LayerNorm(H), Attention(flash), nn.Dropout(P)
        self.ln_2, self.mlp, self.drop_2 = nn.LayerNorm(H), MLP(), nn.Dropout(P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_1(self.attn(self.ln_1(x)))
        return x + self.drop_2(self.mlp(self.ln_2(x)))


class Stack(nn.Module):
    def __init__(self, flash: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(Layer(flash) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def megatron(model: nn.Module, mesh, *, sequence_parallel: bool = False) -> None:
    """Megatron's tensor parallelism (and sequence parallelism) as ``parallelize_module`` writes it
    (PyTorch's TP tutorial, torchtitan's ``apply_tp``): q/k/v and the first MLP Linear column-wise,
    the projections row-wise; ``sequence_parallel``: the norms and the residual stream sharded
    along the sequence, gathered once before the attention and once before the MLP."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    stream = Shard(1) if sequence_parallel else Replicate()
    for layer in model.layers:
        plan = {
            "attn": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
            **{f"attn.{name}": ColwiseParallel() for name in ("q", "k", "v")},
            "attn.proj": RowwiseParallel(output_layouts=stream),
            "mlp": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
            "mlp.fc_1": ColwiseParallel(),
            "mlp.fc_2": RowwiseParallel(output_layouts=stream),
        }
        if sequence_parallel:
            plan |= {"ln_1": SequenceParallel(), "ln_2": SequenceParallel()}
        parallelize_module(layer, mesh, plan)
        layer.attn.heads //= mesh.size()
    if sequence_parallel:  # the stack's input arrives sharded along the sequence, as between layers
        parallelize_module(model, mesh, {"layers.0": PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(stream,), use_local_output=True)})


@dataclass(frozen=True)
class Row:
    setup: str
    paper: sympy.Expr  # bytes per layer, in b, s, h, a, t
    fxmem: sympy.Expr  # the captured layer's, in b and s (h, a, t numbers)
    flash: sympy.Expr  # the same with scaled_dot_product_attention


PAPER = {
    "no parallelism": 34 * s * b * h + 5 * a * s**2 * b,
    "tensor parallel": s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
    "tensor + sequence parallel": s * b * h * (34 / t + 5 * a * s / (h * t)),
}


SEQS = (16, 32, 48)  # the formula in s through these, checked at CHECK
CHECK = 64


def _captured(flash: bool, tp: int, sequence_parallel: bool, seq: int) -> sympy.Expr:
    """The middle layer's activations at ``seq`` tokens, a formula in ``b`` (CUDA target, fp16)."""
    model = Stack(flash).half()
    x = torch.randn(2, seq, H, dtype=torch.float16)
    strategy = Strategy() if tp == 1 else Strategy(
        mesh={"tp": tp}, parallelize=functools.partial(megatron, sequence_parallel=sequence_parallel))
    rep = estimator.report(model, {"x": x}, batch=2, device="cuda", loss_fn=lambda out, sample: out.float().sum(),
                           optimizer=None, strategy=strategy)
    timeline = (rep.ranks[0].report if rep.ranks else rep).timeline  # every rank holds the same here
    total = sum((nbytes for nbytes, category, op, _ in timeline.storages if category is Category.ACTIVATION
                 and op >= 0 and (timeline.ops[op].module + ".").startswith(MIDDLE + ".")), Poly())
    return total.expr.subs({B: b})


def layer_bytes(flash: bool, tp: int, sequence_parallel: bool) -> sympy.Expr:
    """The middle layer's activations in ``b`` and ``s``: the polynomial in ``s`` through the
    captures at ``SEQS`` (each linear in ``b``), checked against the capture at ``CHECK`` (a
    sequence length the fit did not see).  ``s`` is not kept a symbol in one capture: flash
    attention's sizes fix it, and under sequence parallelism sympy does not return on the guards
    of the sharded sequence."""
    found = [_captured(flash, tp, sequence_parallel, seq) for seq in SEQS]
    formula = sympy.expand(sympy.interpolate(list(zip(SEQS, found)), s))
    check = _captured(flash, tp, sequence_parallel, CHECK)
    if sympy.expand(formula.subs(s, CHECK) - check) != 0:
        raise AssertionError(f"the activations are not a quadratic in s: at s = {CHECK} the fit gives "
                             f"{formula.subs(s, CHECK)}, the capture {check}")
    return formula


def rows(tp: int = 2) -> list[Row]:
    out = []
    for setup, sp in (("no parallelism", False), ("tensor parallel", False), ("tensor + sequence parallel", True)):
        t_ = 1 if setup == "no parallelism" else tp
        out.append(Row(setup, PAPER[setup], layer_bytes(False, t_, sp), layer_bytes(True, t_, sp)))
    return out


def terms(expr: sympy.Expr) -> dict[str, sympy.Expr]:
    """``expr`` (numbers for h, a, t) by monomial: ``s·b``, ``s²·b`` and the rest."""
    poly = sympy.Poly(sympy.expand(expr), s, b)
    out = {}
    for (i, j), c in poly.terms():
        out[f"{'s' if i == 1 else f's^{i}' if i else ''}{'·' if i and j else ''}{'b' if j else ''}" or "1"] = c
    return out


def markdown(found: list[Row], tp: int) -> str:
    values = {h: H, a: A, t: tp}
    lines = [
        "# One transformer layer's activations: fxmem next to Korthikanti et al. 2022",
        "",
        "Generated by `python -m validators.korthikanti --markdown docs/korthikanti.md` (its docstring says how the",
        f"layer is set up). Sizes: h = {H}, a = {A} heads, t = {tp}, fp16 activations, dropout {P}, CUDA target",
        "(H100). Bytes one layer keeps for backward, per rank, as formulas in the batch b and the sequence s;",
        "each term is also written in the paper's unit (`sbh` for the `s·b` term, `as²b` for the `s²·b` term).",
        "",
        "| setup | paper (Table 2) | paper at these sizes | fxmem, the paper's kernels | fxmem, flash attention |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in found:
        paper_here = sympy.expand(row.paper.subs(values))
        lines.append(f"| {row.setup} | `{sympy.sstr(sympy.factor(row.paper))}` | `{paper_here}` | `{row.fxmem}` | "
                     f"`{row.flash}` |")
    lines += ["", "## Term by term", "",
              "| setup | term | paper | fxmem, the paper's kernels | in the paper's unit | fxmem, flash attention |",
              "| --- | --- | --- | --- | --- | --- |"]
    for row in found:
        paper, ours, flash = (terms(e) for e in (row.paper.subs(values), row.fxmem, row.flash))
        for term in sorted(set(paper) | set(ours) | set(flash), key=lambda k: (-len(k), k)):
            unit = {"s·b": H, "s^2·b": A}.get(term)
            name = {"s·b": "sbh", "s^2·b": "as²b"}.get(term, "")
            mine = ours.get(term, 0)
            scaled = f"{sympy.nsimplify(mine / unit)} {name}" if unit else "-"
            lines.append(f"| {row.setup} | {term} | {paper.get(term, 0)} | {mine} | {scaled} | {flash.get(term, 0)} |")
    lines += ["", "## Where they differ, and why", "", *_explanations(found, tp), ""]
    return "\n".join(lines)


LN_STATS = 2 * 8  # two LayerNorms, each an fp32 mean and rstd per token kept for backward (B per token)


def _explanations(found: list[Row], tp: int) -> list[str]:
    """What each difference is.  Every claim is checked against the measured terms first: a run
    whose numbers no longer fit it fails here instead of writing a wrong page."""
    plain, tensor, seq = ({k: terms(e).get(k, 0) for k in ("s·b", "s^2·b", "1")} for e in
                          (r.fxmem for r in found))
    flash = terms(found[0].flash)
    assert plain["s^2·b"] == 5 * A and tensor["s^2·b"] == seq["s^2·b"] == 5 * A // tp
    assert plain["s·b"] == 34 * H + LN_STATS
    assert tensor["s·b"] == (10 + 24 // tp) * H + LN_STATS
    gathered = 2 * (2 * H - 2 * H // tp)  # the attention's and the MLP's input, whole instead of 1/t
    assert seq["s·b"] == 34 * H // tp + gathered + LN_STATS // tp
    logsumexp = 4 * A  # flash attention's fp32 row statistics: one per head and token
    assert flash.get("s^2·b", 0) == 0 and flash["s·b"] == plain["s·b"] + logsumexp
    return [
        f"- **The s²·b term** (attention's scores) is the paper's: {plain['s^2·b']} B = 5·a, softmax's fp16 output "
        "(2 B), dropout's 1-byte mask and its fp16 output, kept by the matmul with V (2 B); each rank of a "
        f"tensor-parallel group holds a/t heads: {tensor['s^2·b']} B. Flash attention "
        "(`scaled_dot_product_attention` on an H100) keeps none of it: it recomputes the scores in backward and "
        f"keeps their fp32 log-sum-exp per head and token ({logsumexp} B per s·b), and {flash.get('1', 0)} B that "
        "follow neither b nor s (its dropout's random-number state).",
        f"- **The s·b term, one device**: {plain['s·b']} B = 34·h + {LN_STATS}. The {LN_STATS} B are the two "
        "LayerNorms' fp32 mean and rstd per token, which the paper leaves out. Every other tensor the paper "
        "counts is kept, at its size: q, k and v once each (the views `transpose` makes are not copied), the "
        "GeLU's input and output, the two 1-byte dropout masks.",
        f"- **Tensor parallelism** (t = {tp}): {tensor['s·b']} B = (10 + 24/t)·h + {LN_STATS}: the norms' inputs, "
        "the attention's and the MLP's inputs and the residual dropouts' masks stay whole on every rank, as the "
        "paper says; the same LayerNorm statistics besides.",
        f"- **Sequence parallelism**: {seq['s·b']} B against the paper's 34·h/t = {34 * H // tp}. PyTorch's "
        "`PrepareModuleInput` all-gathers the sequence before the attention and before the MLP, and the "
        "column-parallel Linears keep the gathered, whole-sequence input for their weight gradient: "
        f"2·(2h − 2h/t) = {gathered} B more per s·b. Megatron keeps the sharded input and all-gathers it again "
        f"in backward (the paper's §4.2.3). The LayerNorm statistics are sharded too ({LN_STATS // tp} B).",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", help="write the page here")
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    text = markdown(rows(args.tp), args.tp)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
