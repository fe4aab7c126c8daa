"""Formula export for documentation: LaTeX, Markdown and JSON renderings of a Report.

Bytes stay exact integers (``a + c·b``); a MiB rendering (GiB = 2**30, MiB = 2**20) sits beside
them for reading.  Compute lives in the Report; this module only formats.
"""

from __future__ import annotations

import json

import sympy

from estimator.symbolic import B, Poly
from estimator.units import MiB

_MIB_DIGITS = 6


def _mib(poly: Poly) -> sympy.Expr:
    return sympy.nsimplify(poly.expr / MiB).evalf(_MIB_DIGITS) if poly.coeffs else sympy.Integer(0)


def _range(rep) -> str:
    upper = "∞" if rep.valid_to is None else str(rep.valid_to)
    return f"{rep.valid_from} ≤ b ≤ {upper}"


def _peak_latex(rep, scale) -> str:
    terms = [sympy.latex(scale(p.bytes)) for p in rep.pieces]
    return terms[0] if len(terms) == 1 else r"\max\left(" + ",\\; ".join(terms) + r"\right)"


def to_latex(rep) -> str:
    """An ``align*`` block: the peak in bytes (exact) and in MiB, then each category at the peak."""
    lines = [
        r"\begin{align*}",
        rf"\mathrm{{peak}}(b) &= {_peak_latex(rep, lambda p: p.expr)} \;\text{{B}} \\",
        rf"&\approx {_peak_latex(rep, _mib)} \;\text{{MiB}} \\",
    ]
    for category, poly in rep.breakdown_formula.items():
        if poly.coeffs:
            lines.append(rf"\text{{{category.value}}}(b) &= {sympy.latex(poly.expr)} \;\text{{B}} \\")
    upper = rf" \le {rep.valid_to}" if rep.valid_to is not None else ""
    lines += [rf"&\text{{valid for }} {rep.valid_from} \le b{upper}", r"\end{align*}"]
    return "\n".join(lines)


def to_markdown(rep) -> str:
    """The peak formula and a table of the categories at the peak, as formulas and at ``batch``."""
    peak = " , ".join(f"`{p.expr}`" for p in rep.pieces)
    lines = [
        f"**Peak memory of one {rep.mode.value} step of `{rep.model}`** (bytes; b = batch size; "
        f"{rep.path.value} capture, valid for {_range(rep)}):",
        "",
        f"peak(b) = max({peak})" if len(rep.pieces) > 1 else f"peak(b) = {peak}",
        "",
        f"| category | formula (B) | formula (MiB) | at b = {rep.batch} |",
        "|---|---|---|---:|",
    ]
    for category, poly in rep.breakdown_formula.items():
        if poly.coeffs:
            lines.append(f"| {category.value} | `{poly.expr}` | `{_mib(poly)}` | {poly(rep.batch):,} |")
    total = sum(rep.breakdown_formula.values(), Poly())
    lines.append(f"| **total at the peak** | `{total.expr}` | `{_mib(total)}` | {rep.peak_bytes:,} |")
    if rep.guards:
        lines += ["", "Guards: " + "; ".join(f"`{g}`" for g in rep.guards)]
    return "\n".join(lines) + "\n"


def to_json(rep, indent: int | None = 2) -> str:
    """``Report.to_dict()`` with exact integer coefficients for every formula, as JSON."""
    data = rep.to_dict()
    data["symbol"] = str(B)
    data["breakdown_coefficients"] = {c.value: list(p.coeffs) for c, p in rep.breakdown_formula.items()}
    return json.dumps(data, indent=indent)
