"""Formula export for documentation: LaTeX, Markdown and JSON renderings of a Report.

Bytes stay exact integers (``a + c·b``); a MiB rendering (GiB = 2**30, MiB = 2**20) sits beside
them for reading.  Compute lives in the Report; this module only formats.
"""

from __future__ import annotations

import json

import sympy

from estimator.vocab.categories import Category
from estimator.vocab.symbolic import ZERO, B, Poly, S, W, WidthPoly
from estimator.vocab.units import MiB

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
    if (per := rep.optimizer_state_per_param) is not None:
        lines.append(rf"\text{{optimizer state per trainable parameter}} &= {per:.4g} \;\text{{B}} "
                     rf"\quad (\Psi = {rep.trainable_params}) \\")
    valid = range_text(rep).replace("≤", r"\le").replace("∞", r"\infty")
    lines += [rf"&\text{{valid for }} {valid}", r"\end{align*}"]
    if rep.dtype_formula is not None:
        lines += dtype_latex(rep.dtype_formula)
    if rep.depth_formula is not None:
        lines += depth_latex(rep.depth_formula)
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
    if (per := rep.optimizer_state_per_param) is not None:
        lines += ["", f"Optimizer state ({rep.optimizer}): {rep.breakdown.get(Category.OPTIMIZER_STATE, 0):,} B over "
                      f"Ψ = {rep.trainable_params:,} trainable parameters, {per:.4g} B per parameter."]
    if rep.ranks:
        lines += ["", f"Per device ({rep.strategy.describe()}; the table above is the worst device's):", "",
                  "| device | ranks | peak formula (B) | at b |", "|---|---|---|---:|"]
        for r in rep.ranks:
            formula = " , ".join(f"`{p.expr}`" for p in r.report.pieces)
            lines.append(f"| {r.role} | {', '.join(map(str, r.ranks))} | "
                         f"{'max(' + formula + ')' if len(r.report.pieces) > 1 else formula} | {r.report.peak_bytes:,} |")
    if rep.guards:
        lines += ["", "Guards: " + "; ".join(f"`{g}`" for g in rep.guards)]
    if rep.dtype_formula is not None:
        lines += ["", *dtype_markdown(rep.dtype_formula)]
    if rep.depth_formula is not None:
        lines += ["", *depth_markdown(rep.depth_formula, rep.batch, rep.seq)]
    return "\n".join(lines) + "\n"


def to_json(rep, indent: int | None = 2) -> str:
    """``Report.to_dict()`` with exact integer coefficients for every formula, as JSON."""
    data = rep.to_dict()
    data["symbol"] = str(B)
    if rep.seq is not None:
        data["symbols"] = [str(B), str(S)]
    data["breakdown_coefficients"] = {c.value: coefficients(p) for c, p in rep.breakdown_formula.items()}
    data["trainable_parameters"] = rep.trainable_params
    data["optimizer_state_per_parameter"] = rep.optimizer_state_per_param
    if rep.dtype_formula is not None:
        data["dtype_formula"] = dtype_dict(rep.dtype_formula)
    if rep.depth_formula is not None:
        data["depth_formula"] = depth_dict(rep.depth_formula)
    return json.dumps(data, indent=indent)


# report(depth_symbols=True): the peak in b (s) and L, the number of the model's repeated blocks.
def _depth_symbols(df) -> str:
    return "b, s, L" if df.seq is not None else "b, L"


def _depth_range(df) -> str:
    every = f" (every {df.period})" if df.period > 1 else ""
    upper = "∞" if df.valid_to is None else str(df.valid_to)
    return f"L ≥ {df.blocks_from}{every}, {df.valid_from} ≤ b ≤ {upper}"


def _depth_pieces(df) -> list[sympy.Expr]:
    peak = df.peak
    return list(peak.args) if isinstance(peak, sympy.Max) else [peak]


def depth_latex(df) -> list[str]:
    """An ``align*`` block: the peak in ``b`` and ``L``, and where it holds."""
    terms = [sympy.latex(t) for t in _depth_pieces(df)]
    peak = terms[0] if len(terms) == 1 else r"\max\left(" + ",\\; ".join(terms) + r"\right)"
    valid = _depth_range(df).replace("≤", r"\le").replace("≥", r"\ge").replace("∞", r"\infty")
    return [r"\begin{align*}", rf"\mathrm{{peak}}({_depth_symbols(df)}) &= {peak} \;\text{{B}} \\",
            rf"&\text{{L: blocks of {df.path} ({df.blocks} in the model); valid for }} {valid}", r"\end{align*}"]


def depth_markdown(df, batch: int, seq: int | None) -> list[str]:
    """The depth formula: the peak in ``b`` and ``L``, its value at the batch for a few depths, its notes."""
    pieces = _depth_pieces(df)
    terms = " , ".join(f"`{t}`" for t in pieces)
    units = (df.blocks - df.head) // df.period
    depths = sorted({df.head + df.period * u for u in (df.units_from, units, 2 * units)})
    out = [f"**In terms of depth** (L = blocks of `{df.path}`, {df.blocks} in the model; "
           f"valid for {_depth_range(df)}):",
           "", f"peak({_depth_symbols(df)}) = " + (f"max({terms})" if len(pieces) > 1 else terms), ""]
    if df.holds_at(batch):
        out += [f"| L | peak at b = {batch} (B) |", "|---:|---:|",
                *(f"| {n} | {df.at(batch, n, seq):,} |" for n in depths)]
    else:
        out.append(f"(b = {batch} lies outside the formula's range of b)")
    return out + ["", *(f"- {note}" for note in df.notes)]


def depth_dict(df) -> dict:
    """The depth formula as JSON-ready data: each piece ``fixed + units·per_unit`` with exact
    integer coefficients, ``units = (L - head) / period``."""
    return {"symbols": [str(B), *([str(S)] if df.seq is not None else []), "L"], "peak": str(df.peak),
            "path": df.path, "blocks": df.blocks, "head": df.head, "period": df.period,
            "blocks_from": df.blocks_from, "valid_from": df.valid_from, "valid_to": df.valid_to,
            "pieces": [{"fixed": coefficients(p.fixed), "per_unit": coefficients(p.per_unit)} for p in df.pieces],
            "notes": list(df.notes)}


# report(dtype_symbols=True): the formulas in b (s) and w, the element width of the model's dtype.
PSI = sympy.Symbol("Psi", integer=True, positive=True)  # Ψ: trainable parameters
_PSI_CATEGORIES = (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE)


def psi_expr(poly: WidthPoly, psi: int) -> sympy.Expr | None:
    """Bytes without ``b`` or ``s`` written in Ψ (``psi`` trainable parameters): ``kΨ·w + qΨ + r``
    with ``0 <= r < Ψ`` (Adam's state ``2Ψ·w + 24``: the step counters); None when the coefficient of
    ``w`` is not a multiple of Ψ (frozen parameters) or the bytes depend on the batch."""
    a, c, d = poly.terms
    if d != 1 or psi <= 0 or max(a.degree, c.degree) > 0 or a.has_s or c.has_s:
        return None
    k, (q, r) = divmod(c.coeff(0), psi), divmod(a.coeff(0), psi)
    if k[1] or k[0] < 0 or q < 0:
        return None
    return k[0] * PSI * W + q * PSI + r


def _groups(line) -> list[tuple[tuple[str, ...], object]]:
    """``(dtypes, piece)`` for each distinct peak piece of ``line``: the dtypes whose peak it is."""
    groups: dict[int, list[str]] = {}
    for dtype, index in line.peaks.items():
        groups.setdefault(index, []).append(dtype)
    return [(tuple(dtypes), line.pieces[index]) for index, dtypes in groups.items()]


def widths_text(widths) -> str:
    """``{"fp32": 4, "bf16": 2}`` -> ``"w = 4: fp32; w = 2: bf16"``."""
    by: dict[int, list[str]] = {}
    for dtype, w in widths.items():
        by.setdefault(w, []).append(dtype)
    return "; ".join(f"w = {w}: {', '.join(names)}" for w, names in sorted(by.items(), reverse=True))


def _where(piece) -> str:
    return f"{piece.phase.value}: {piece.op}" + (f" in {piece.module}" if piece.module else "")


def _dtype_symbols(df) -> str:
    return "b, s, w" if df.seq is not None else "b, w"


def dtype_latex(df) -> list[str]:
    """One ``align*`` block per line of the dtype formula: the peak in ``b`` and ``w``, then the
    categories at each dtype's peak (with their Ψ form)."""
    out = []
    for line in df.lines:
        terms = [sympy.latex(p.expr) for p in line.pieces]
        peak = terms[0] if len(terms) == 1 else r"\max\left(" + ",\\; ".join(terms) + r"\right)"
        out += [r"\begin{align*}",
                rf"\mathrm{{peak}}({_dtype_symbols(df)}) &= {peak} \;\text{{B}} \\",
                rf"&\text{{{widths_text(line.widths)}}} \\"]
        for dtypes, piece in _groups(line):
            out.append(rf"&\text{{at the peak of {', '.join(dtypes)} ({_where(piece)}):}} \\")
            for category, poly in piece.breakdown.items():
                if poly.lo == ZERO and poly.hi == ZERO:
                    continue
                psi = psi_expr(poly, df.params) if category in _PSI_CATEGORIES else None
                extra = f" = {sympy.latex(psi)}" if psi is not None and psi != poly.expr else ""
                out.append(rf"\text{{{category.value}}}({_dtype_symbols(df)}) &= {sympy.latex(poly.expr)}{extra}"
                           r" \;\text{B} \\")
        upper = r"\infty" if df.valid_to is None else str(df.valid_to)
        out += [rf"&\text{{valid for }} {df.valid_from} \le b \le {upper},\; \Psi = {df.params}"
                r" \text{ trainable parameters}", r"\end{align*}"]
    return out


def dtype_markdown(df) -> list[str]:
    """The dtype formula: the peak in ``b`` and ``w`` per line, a table of the categories at each
    dtype's peak (formula, Ψ form, bytes at the batch), and its notes."""
    out = [f"**In terms of the dtype** (w = bytes per element of the model's float dtype, {df.model_dtype} as given; "
           f"Ψ = {df.params:,} trainable parameters; valid for {df.valid_from} ≤ b ≤ "
           f"{'∞' if df.valid_to is None else df.valid_to}):"]
    at = f"b = {df.batch}" + (f", s = {df.seq}" if df.seq is not None else "")
    for line in df.lines:
        peak = " , ".join(f"`{p.expr}`" for p in line.pieces)
        out += ["", f"peak({_dtype_symbols(df)}) = " + (f"max({peak})" if len(line.pieces) > 1 else peak)
                + f" ({widths_text(line.widths)})"]
        for dtypes, piece in _groups(line):
            out += ["", f"| at the peak of {', '.join(dtypes)} ({_where(piece)}) | formula (B) | in Ψ | "
                    + " | ".join(f"{d} at {at}" for d in dtypes) + " |",
                    "|---|---|---|" + "---:|" * len(dtypes)]
            for category, poly in piece.breakdown.items():
                if poly.lo == ZERO and poly.hi == ZERO:
                    continue
                psi = psi_expr(poly, df.params) if category in _PSI_CATEGORIES else None
                psi_text = "" if psi is None else f"`{str(psi).replace('Psi', 'Ψ').replace('*', '·')}`"
                values = " | ".join(f"{_value(poly, line.widths[d], df):,}" for d in dtypes)
                out.append(f"| {category.value} | `{poly.expr}` | {psi_text} | {values} |")
    out += ["", *(f"- {note}" for note in df.notes)]
    return out


def _value(poly: WidthPoly, w: int, df) -> int:
    p = poly.at_width(w)
    return p(df.batch, df.seq) if p.has_s else p(df.batch)


def width_coefficients(poly: WidthPoly) -> dict:
    """``{"formula", "numerator_const", "numerator_w", "denominator"}``: the bytes are
    ``(numerator_const + numerator_w·w) / denominator``, exact integer coefficients (``coefficients``)."""
    a, c, d = poly.terms
    return {"formula": str(poly.expr), "numerator_const": coefficients(a), "numerator_w": coefficients(c),
            "denominator": d}


def dtype_dict(df) -> dict:
    """The dtype formula as JSON-ready data, with exact integer coefficients."""
    lines = []
    for line in df.lines:
        peaks = {}
        for dtype, index in line.peaks.items():
            piece = line.pieces[index]
            peaks[dtype] = {
                "piece": index, "bytes": _value(piece.bytes, line.widths[dtype], df),
                "breakdown": {c.value: {**width_coefficients(p), "bytes": _value(p, line.widths[dtype], df),
                                        **({"psi": str(e)} if (e := psi_expr(p, df.params)) is not None
                                           and c in _PSI_CATEGORIES else {})}
                              for c, p in piece.breakdown.items()},
            }
        lines.append({
            "widths": dict(line.widths), "peak": str(line.peak),
            "pieces": [{**width_coefficients(p.bytes), "phase": p.phase.value, "op": p.op, "module": p.module}
                       for p in line.pieces],
            "peaks": peaks,
        })
    return {"symbols": [str(B), *([str(S)] if df.seq is not None else []), str(W)], "width": str(W),
            "model_dtype": df.model_dtype, "psi": df.params, "batch": df.batch, "seq": df.seq,
            "valid_from": df.valid_from, "valid_to": df.valid_to, "guards": list(df.guards), "lines": lines,
            "notes": list(df.notes)}
