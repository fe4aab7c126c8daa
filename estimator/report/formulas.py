"""Formula export for documentation: LaTeX, Markdown and JSON renderings of a Report.

Bytes stay exact integers (``a + c·b``); a MiB rendering (GiB = 2**30, MiB = 2**20) sits beside
them for reading.  Compute lives in the Report; this module only formats.
"""

from __future__ import annotations

import json

import sympy

from estimator.symbolic import ZERO, B, Poly, S
from estimator.units import MiB

_MIB_DIGITS = 6


def _mib(poly: Poly) -> sympy.Expr:
    return sympy.nsimplify(poly.expr / MiB).evalf(_MIB_DIGITS) if poly != ZERO else sympy.Integer(0)


def range_text(rep) -> str:
    upper = "∞" if rep.valid_to is None else str(rep.valid_to)
    text = f"{rep.valid_from} ≤ b ≤ {upper}"
    if rep.seq is not None:
        lo, hi = rep.seq_range
        text += f", {lo} ≤ s ≤ {'∞' if hi is None else hi}"
    return text


def symbols_text(rep) -> str:
    return "b, s" if rep.seq is not None else "b"


def coefficients(poly: Poly):
    """Exact integer coefficients: ``[c0, c1, ...]`` of ``b**i``, or, for a formula in ``b`` and
    ``s``, ``{"b": [...], "b_s": [[i, j, c], ...]}`` (``c * b**i * s**j``)."""
    if not poly.has_s:
        return list(poly.coeffs)
    return {"b": list(poly.coeffs), "b_s": [list(t) for t in poly.mixed]}


def _peak_latex(rep, scale) -> str:
    terms = [sympy.latex(scale(p.bytes)) for p in rep.pieces]
    return terms[0] if len(terms) == 1 else r"\max\left(" + ",\\; ".join(terms) + r"\right)"


def to_latex(rep) -> str:
    """An ``align*`` block: the peak in bytes (exact) and in MiB, then each category at the peak."""
    lines = [
        r"\begin{align*}",
        rf"\mathrm{{peak}}({symbols_text(rep)}) &= {_peak_latex(rep, lambda p: p.expr)} \;\text{{B}} \\",
        rf"&\approx {_peak_latex(rep, _mib)} \;\text{{MiB}} \\",
    ]
    for category, poly in rep.breakdown_formula.items():
        if poly != ZERO:
            lines.append(rf"\text{{{category.value}}}({symbols_text(rep)}) &= {sympy.latex(poly.expr)} \;\text{{B}} \\")
    valid = range_text(rep).replace("≤", r"\le").replace("∞", r"\infty")
    lines += [rf"&\text{{valid for }} {valid}", r"\end{align*}"]
    return "\n".join(lines)


def to_markdown(rep) -> str:
    """The peak formula and a table of the categories at the peak, as formulas and at ``batch``."""
    peak = " , ".join(f"`{p.expr}`" for p in rep.pieces)
    lines = [
        (f"**Peak memory of one {rep.mode.value} step of `{rep.model}`**"
         + (f" with {rep.strategy.describe()}" if rep.strategy.describe() != "single device" else "")
         + " (bytes; b = batch size; "
         + ("s = sequence length; " if rep.seq is not None else "")
         + f"{rep.path.value} capture, valid for {range_text(rep)}):"),
        "",
        f"peak({symbols_text(rep)}) = max({peak})" if len(rep.pieces) > 1 else f"peak({symbols_text(rep)}) = {peak}",
        "",
        f"| category | formula (B) | formula (MiB) | at b = {rep.batch}"
        + (f", s = {rep.seq}" if rep.seq is not None else "") + " |",
        "|---|---|---|---:|",
    ]
    for category, poly in rep.breakdown_formula.items():
        if poly != ZERO:
            lines.append(f"| {category.value} | `{poly.expr}` | `{_mib(poly)}` | {poly(rep.batch, rep.seq):,} |")
    total = sum(rep.breakdown_formula.values(), Poly())
    lines.append(f"| **total at the peak** | `{total.expr}` | `{_mib(total)}` | {rep.peak_bytes:,} |")
    if rep.ranks:
        lines += ["", f"Per device ({rep.strategy.describe()}; the table above is the worst device's):", "",
                  "| device | ranks | peak formula (B) | at b |", "|---|---|---|---:|"]
        for r in rep.ranks:
            formula = " , ".join(f"`{p.expr}`" for p in r.report.pieces)
            lines.append(f"| {r.role} | {', '.join(map(str, r.ranks))} | "
                         f"{'max(' + formula + ')' if len(r.report.pieces) > 1 else formula} | {r.report.peak_bytes:,} |")
    if rep.guards:
        lines += ["", "Guards: " + "; ".join(f"`{g}`" for g in rep.guards)]
    return "\n".join(lines) + "\n"


def to_json(rep, indent: int | None = 2) -> str:
    """``Report.to_dict()`` with exact integer coefficients for every formula, as JSON."""
    data = rep.to_dict()
    data["symbol"] = str(B)
    if rep.seq is not None:
        data["symbols"] = [str(B), str(S)]
    data["breakdown_coefficients"] = {c.value: coefficients(p) for c, p in rep.breakdown_formula.items()}
    return json.dumps(data, indent=indent)
