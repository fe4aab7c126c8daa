"""``report(dtype_symbols=True)``: the peak and its categories in ``b`` and the element width
``w`` of the model's float dtype, exact against separate captures at fp32, bf16 and fp16.

"Separate capture" is what a user gets from ``estimator.report`` of ``model.to(dtype)`` with the
sample's float tensors ``.to(dtype)``: the dtype formula at ``w = 4`` must give the fp32 report's
pieces, peak op and categories exactly, at ``w = 2`` the bf16 report's and the fp16 report's.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.utils._pytree import tree_map

import estimator
import models_zoo
from estimator import Strategy
from estimator.cli import cli
from estimator.vocab.categories import Category
from estimator.vocab.errors import InputError
from estimator.vocab.symbolic import nondominated

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BATCH = 8
# mlp debug: Linear(32, 64), Linear(64, 64), Linear(64, 10) with biases:
# Ψ = (32·64 + 64) + (64·64 + 64) + (64·10 + 10) = 2,112 + 4,160 + 650 = 6,922 trainable parameters.
PSI_MLP = 6922


def _cast(sample, dtype: torch.dtype):
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t, sample)


def _zoo(name: str, dtype: str):
    """The zoo model's debug size in ``dtype`` (gpt with one block: the same ops, half the capture)."""
    if name == "gpt":
        model, make_sample, loss_fn = models_zoo.gpt.make(dataclasses.replace(models_zoo.gpt.SIZES["debug"],
                                                                              n_layer=1))
        model = model.to(DTYPES[dtype])
    else:
        model, make_sample, loss_fn = models_zoo.get(name, "debug", dtype=DTYPES[dtype])
    return model, _cast(make_sample(BATCH), DTYPES[dtype]), loss_fn


@functools.cache
def separate(name: str, device: str, dtype: str, **kwargs) -> estimator.Report:
    """The zoo model built in ``dtype`` (float sample tensors too), estimated on its own."""
    model, sample, loss_fn = _zoo(name, dtype)
    return estimator.report(model, sample, batch=BATCH, loss_fn=loss_fn, device=device, **kwargs)


@functools.cache
def symbolic(name: str, device: str, dtype: str = "fp32", **kwargs) -> estimator.Report:
    model, sample, loss_fn = _zoo(name, dtype)
    return estimator.report(model, sample, batch=BATCH, loss_fn=loss_fn, device=device, dtype_symbols=True, **kwargs)


def assert_exact(df, dtype: str, rep: estimator.Report) -> None:
    """The dtype formula at ``dtype``'s width is ``rep``'s formula: the same non-dominated pieces
    (so the same ``Max``), the same peak op at the batch and the same categories there."""
    line = df.line(dtype)
    pieces = line.pieces_at(dtype)
    assert {pieces[i] for i in nondominated(pieces, df.valid_from, df.valid_to)} == {p.bytes for p in rep.pieces}
    assert (df.valid_from, df.valid_to) == (rep.valid_from, rep.valid_to)
    peak = df.peak_piece(dtype)
    assert (peak.phase, peak.op, peak.module) == (rep.peak_piece.phase, rep.peak_piece.op, rep.peak_piece.module)
    assert {c: v.at_width(DTYPES[dtype].itemsize) for c, v in peak.breakdown.items()} == dict(rep.breakdown_formula)
    for b in (2, 3, BATCH, df.valid_to or 1000):
        assert df.at(b, dtype) == max(p.bytes(b) for p in rep.pieces)


# mlp: one program at every width (CPU: oneDNN keeps matmul scratch for bf16 only, so fp16 gets a line
# of its own); gpt: CPU attention upcasts bf16 q, k, v to fp32 (ops only at bf16), CUDA runs
# mem-efficient attention at fp32 and flash at bf16/fp16 (other ops).  The whole zoo on both targets
# is in docs/design.md ("The dtype as a symbol"); these keep the suite fast.
CASES = [("cpu", "mlp"), ("cpu", "gpt"), ("cuda", "mlp"), ("cuda", "gpt")]


@pytest.mark.parametrize("device, name", CASES)
def test_exact_against_separate_captures(device, name):
    rep = symbolic(name, device)
    df = rep.dtype_formula
    assert df.model_dtype == "fp32" and df.dtypes == ("fp32", "bf16", "fp16")
    assert_exact(df, "fp32", rep)  # the report of the fp32 model itself: its own capture, aligned with bf16's
    for dtype in ("bf16", "fp16"):
        assert_exact(df, dtype, separate(name, device, dtype))
    if device == "cuda":  # CUDA's rules depend on the width only: fp16 holds bf16's bytes at every op
        assert len(df.lines) == 1
        assert any("exact at fp16 too" in n and "at every op" in n for n in df.notes)


def test_classes_of_tensors():
    """CUDA, mlp, AdamW (foreach; the step counters stay on the host) at the optimizer step: the
    parameters, their gradients and Adam's two moments follow the dtype -- Ψ·w, Ψ·w, 2Ψ·w -- and
    the int64 labels do not: inputs 32·b·w (x: 32 features) + 8·b."""
    df = symbolic("mlp", "cuda").dtype_formula
    piece = df.peak_piece("bf16")
    assert piece is df.peak_piece("fp32") and piece.phase.value == "optimizer"
    parts = {c: piece.breakdown[c].terms for c in (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE,
                                                   Category.INPUT)}
    assert [(a.coeffs, c.coeffs, d) for a, c, d in parts.values()] == [
        ((), (PSI_MLP,), 1), ((), (PSI_MLP,), 1), ((), (2 * PSI_MLP,), 1), ((0, 8), (0, 32), 1)]
    assert df.params == PSI_MLP


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_mixed_precision_adam_is_2_2_12_psi(device):
    """A bf16 model trained through fp32 master weights with Adam (``Strategy(master_weights=True)``):
    at the optimizer step the parameters are Ψ·w, the gradients Ψ·w and the optimizer state the
    fp32 master copy and Adam's two fp32 moments, 12Ψ whatever w is -- at w = 2 the classic
    2Ψ + 2Ψ + 12Ψ (Ψ = 6,922, mlp debug).  CPU: + 6 × 4 B, one fp32 ``step`` counter per parameter
    tensor (the for-loop Adam keeps them with the state); CUDA: none (the masters' Adam takes the
    foreach path, as on a GPU, and keeps its ``step`` counters on the host)."""
    kwargs = {"optimizer": "adam", "strategy": Strategy(master_weights=True)}
    rep = symbolic("mlp", device, "bf16", **kwargs)
    df = rep.dtype_formula
    assert df.model_dtype == "bf16" and df.params == PSI_MLP
    at_peak = df.breakdown_formula  # at the bf16 model's own peak: the optimizer step
    assert df.peak_piece("bf16").phase.value == "optimizer"
    state = at_peak[Category.OPTIMIZER_STATE]
    counters = state.lo(BATCH) - 12 * PSI_MLP
    assert counters == (6 * 4 if device == "cpu" else 0)
    assert str(at_peak[Category.PARAMETER].expr) == f"{PSI_MLP}*w"
    assert str(at_peak[Category.GRADIENT].expr) == f"{PSI_MLP}*w"
    assert str(at_peak[Category.OPTIMIZER_STATE].expr) == str(12 * PSI_MLP + counters)
    bf16 = {c: v.at_width(2)(BATCH) for c, v in at_peak.items()}
    assert (bf16[Category.PARAMETER], bf16[Category.GRADIENT], bf16[Category.OPTIMIZER_STATE]) == (
        2 * PSI_MLP, 2 * PSI_MLP, 12 * PSI_MLP + counters)
    assert_exact(df, "bf16", rep)
    assert_exact(df, "fp16", separate("mlp", device, "fp16", **kwargs))
    markdown = rep.to_markdown()
    assert "`Ψ·w`" in markdown and f"`12·Ψ{f' + {counters}' if counters else ''}`" in markdown
    assert r"= \Psi w" in rep.to_latex()


class _Fp16Upcast(nn.Module):
    """Upcasts its output only in fp16 (a softmax kept in fp32 for fp16's small range)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        y = self.fc(x)
        return y.float() if y.dtype == torch.float16 else y


def test_fp16_gets_its_own_line_where_its_step_differs():
    """An fp16-only ``_to_copy``: fp16 cannot share bf16's line, so it gets its own (through fp32 and
    fp16), exact at fp16; the bf16 line stays exact at fp32 and bf16."""
    model, x = _Fp16Upcast(), torch.randn(4, 16)
    rep = estimator.report(model, x, batch=4, device="cuda", dtype_symbols=True)
    df = rep.dtype_formula
    assert [dict(line.widths) for line in df.lines] == [{"fp32": 4, "bf16": 2}, {"fp32": 4, "fp16": 2}]
    assert any("line of its own" in n and "different ops" in n for n in df.notes)
    for dtype in ("bf16", "fp16"):
        own = estimator.report(model.to(DTYPES[dtype]), x.to(DTYPES[dtype]), batch=4, device="cuda")
        assert_exact(df, dtype, own)
        model.float()
    assert_exact(df, "fp32", rep)


def test_programs_that_differ_are_aligned_and_named():
    """CPU attention upcasts bf16 q, k, v to fp32 (ops only at bf16): aligned op by op, noted."""
    df = symbolic("gpt", "cpu").dtype_formula
    note = next(n for n in df.notes if "steps run different ops" in n)
    assert "only at bf16" in note and "9 × _to_copy.default (transformer.h.0.attn)" in note


def test_exports():
    rep = symbolic("mlp", "cuda")
    df = rep.dtype_formula
    data = json.loads(rep.to_json())["dtype_formula"]
    assert data["symbols"] == ["b", "w"] and data["psi"] == PSI_MLP
    bf16 = data["lines"][0]["peaks"]["bf16"]
    params = bf16["breakdown"]["parameters"]
    assert (params["numerator_const"], params["numerator_w"], params["denominator"]) == ([], [PSI_MLP], 1)
    assert params["psi"] == "Psi*w"
    separate_bf16 = separate("mlp", "cuda", "bf16")
    for category, value in bf16["breakdown"].items():  # (const + w·c) / d at w = 2, b = 8: the bf16 report's
        const = sum(c * BATCH**i for i, c in enumerate(value["numerator_const"]))
        per_w = sum(c * BATCH**i for i, c in enumerate(value["numerator_w"]))
        expected = separate_bf16.breakdown[Category(category)]
        assert (const + 2 * per_w) // value["denominator"] == value["bytes"] == expected
    assert bf16["bytes"] == max(p.bytes(BATCH) for p in separate_bf16.pieces)
    markdown = rep.to_markdown()
    assert "**In terms of the dtype**" in markdown and "`2·Ψ·w`" in markdown
    assert r"\mathrm{peak}(b, w)" in rep.to_latex()
    assert str(df.peak) == str(df.lines[0].peak)


def test_cli_dtype_symbols():
    result = CliRunner().invoke(cli, ["formula", "mlp", "--device", "cuda", "--dtype-symbols", "--format", "json",
                                      "-q"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)["dtype_formula"]
    assert data["lines"][0]["widths"] == {"fp32": 4, "bf16": 2, "fp16": 2}
    refused = CliRunner().invoke(cli, ["report", "mlp", "--device", "cpu", "--amp", "bf16", "--dtype-symbols", "-q"])
    assert refused.exit_code == 2 and "autocast computes in a 16-bit dtype only" in refused.output


def test_refusals():
    model, x = nn.Linear(8, 4), torch.randn(4, 8)
    with pytest.raises(InputError, match="16-bit dtype only"):
        estimator.report(model, x, device="cpu", amp="bf16", dtype_symbols=True)
    with pytest.raises(InputError, match="one device's step"):
        estimator.report(model, x, device="cpu", strategy=Strategy(data_parallel=2), dtype_symbols=True)
    with pytest.raises(InputError, match="one float dtype"):
        mixed = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4).to(torch.bfloat16))
        estimator.report(mixed, x, device="cpu", dtype_symbols=True)
    with pytest.raises(InputError, match="no floating-point parameter"):
        estimator.report(nn.ReLU(), x, device="cpu", optimizer=None, dtype_symbols=True)
    with pytest.raises(InputError, match="dtype_symbols must be True or False"):
        estimator.report(model, x, device="cpu", dtype_symbols="yes")
    df = symbolic("mlp", "cuda").dtype_formula
    with pytest.raises(InputError, match="extrapolation"):
        df.at(8, torch.float64)
    with pytest.raises(InputError, match="holds for 2 <= b"):
        df.at(1, "bf16")


def test_user_model_untouched():
    """The captures at other dtypes cast copies: the user's model and sample keep their dtype."""
    model, x = nn.Linear(8, 4), torch.randn(4, 8)
    estimator.report(model, x, device="cpu", optimizer="sgd", dtype_symbols=True)
    assert model.weight.dtype == x.dtype == torch.float32
