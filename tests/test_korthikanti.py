"""One transformer layer's activations against Korthikanti et al. 2022 (``validators/korthikanti.py``,
docs/korthikanti.md): the paper's layer, fp16 on the CUDA target, h = 64, a = 4 heads."""

from __future__ import annotations

import sympy

from validators import korthikanti as k

b, s = k.b, k.s


def test_one_device_is_the_papers_count_plus_the_layernorm_statistics():
    # 34·s·b·h + 5·a·s²·b = 2,176·sb + 20·s²b; + 2 LayerNorms x (fp32 mean + rstd) = 16·sb
    assert k.layer_bytes(False, 1, False) == 20 * b * s**2 + (34 * 64 + 16) * b * s


def test_sequence_parallel_keeps_the_gathered_linear_inputs():
    # the paper: s·b·h·(34/t + 5·a·s/(h·t)) = 1,088·sb + 10·s²b at t = 2; PyTorch keeps the attention's
    # and the MLP's gathered inputs whole (2 x (2h - 2h/t) = 128·sb) and the sharded statistics (8·sb)
    assert k.layer_bytes(False, 2, True) == 10 * b * s**2 + (1088 + 128 + 8) * b * s
    assert sympy.expand(k.PAPER["tensor + sequence parallel"].subs({k.h: 64, k.a: 4, k.t: 2})) == \
        10 * b * s**2 + 1088 * b * s
