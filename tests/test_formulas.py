"""Formula export (LaTeX, Markdown, JSON) of a hand-checked report."""

import json

import pytest
import torch
from torch import nn

import estimator


@pytest.fixture(scope="module")
def rep():
    # Linear(16, 4) + SGD, the case tests/test_exact.py derives by hand: peak 96 b + 552 B,
    # params 16*4*4 + 4*4 = 272 B.
    return estimator.report(nn.Linear(16, 4), torch.randn(8, 16), optimizer="sgd", device="cpu")


def test_latex(rep):
    latex = rep.to_latex()
    assert latex.startswith(r"\begin{align*}") and latex.endswith(r"\end{align*}")
    assert r"\mathrm{peak}(b) &= 96 b + 552 \;\text{B}" in latex
    assert r"\text{parameters}(b) &= 272 \;\text{B}" in latex
    assert r"\text{valid for } 2 \le b" in latex


def test_markdown(rep):
    md = rep.to_markdown()
    assert "peak(b) = `96*b + 552`" in md
    assert "| parameters | `272` |" in md
    assert "| **total at the peak** | `96*b + 552` |" in md
    assert f"| {rep.peak_bytes:,} |" in md  # 96*8 + 552 = 1,320


def test_json_has_exact_coefficients(rep):
    data = json.loads(rep.to_json())
    assert data["peak_bytes"] == 96 * 8 + 552
    assert data["pieces"][0]["bytes"] == [552, 96]
    assert data["breakdown_coefficients"]["parameters"] == [272]
    assert data["symbol"] == "b"
