"""Exact arithmetic of the symbolic layer: polynomials, the upper envelope, max batch."""

import itertools

import pytest
import sympy

from estimator.vocab.symbolic import B, NotPolynomial, Poly, S, fit, max_fitting, nondominated


def test_poly_arithmetic_and_expr():
    p = Poly.of(64 * B + 2048)
    assert p.coeffs == (2048, 64)
    assert (p + Poly.const(48))(10) == 2048 + 48 + 640
    assert (p - p).coeffs == ()
    assert p.expr == 64 * B + 2048


def _same_tree(a: sympy.Basic, b: sympy.Basic) -> bool:
    return type(a) is type(b) and a == b and hash(a) == hash(b) and len(a.args) == len(b.args) and \
        all(_same_tree(x, y) for x, y in zip(a.args, b.args))


@pytest.mark.parametrize("coeffs, mixed", [
    *itertools.product([(), (0,), (7,), (0, 1), (0, -1), (5, 1, 1), (-3, 0, 2), (2**40 + 3, -(2**33), 0, 9)],
                       [(), ((0, 1, 1),), ((1, 1, -4), (2, 2, 3))]),
])
def test_expr_is_the_tree_sympy_builds(coeffs, mixed):
    # Poly.expr builds sympy's canonical form directly: the same tree as multiplying out, so
    # printing, hashing and substitution cannot tell the two apart.
    p = Poly.of(sum((c * B**i for i, c in enumerate(coeffs)), sympy.Integer(0))
                + sum((c * B**i * S**j for i, j, c in mixed), sympy.Integer(0)))
    built = sum([sympy.Integer(c) * B**i for i, c in enumerate(p.coeffs)]
                + [sympy.Integer(c) * B**i * S**j for i, j, c in p.mixed], sympy.Integer(0))
    assert _same_tree(p.expr, built)
    assert str(p.expr) == str(built) and sympy.srepr(p.expr) == sympy.srepr(built)


def test_subtraction_is_adding_the_negation():
    polys = [Poly(), Poly((5,)), Poly((0, 3)), Poly((1, -2, 4)), Poly((7,), ((0, 1, 2),)),
             Poly((), ((0, 1, 2), (1, 1, -1)))]
    for p, q in itertools.product(polys, repeat=2):
        assert p - q == p + (-q)
        assert (p - q) + q == p


def test_sums_and_values_agree_with_sympy():
    # byte counts of degree <= 1 take paths of their own (two lines each): the same trimmed Poly and the same
    # values as the general one, cancellations to 0 included
    polys = [Poly(), Poly((5,)), Poly((-5,)), Poly((0, 3)), Poly((4, -3)), Poly((-4, 3)), Poly((1, -2, 4)),
             Poly((7,), ((0, 1, 2),))]
    for p, q in itertools.product(polys, repeat=2):
        for total, expected in ((p + q, p.expr + q.expr), (p - q, p.expr - q.expr)):
            assert total == Poly.of(sympy.expand(expected)) and total.expr == sympy.expand(expected)
            assert total(3, 2) == expected.subs({B: 3, S: 2})


def test_non_polynomial_rejected():
    with pytest.raises(NotPolynomial):
        Poly.of(sympy.floor(B / 2))
    with pytest.raises(NotPolynomial):
        Poly.of(sympy.Symbol("s") * 4)


def test_fit_is_exact_or_refuses():
    assert fit([(2, 100), (3, 150), (4, 200)]).coeffs == (0, 50)
    with pytest.raises(NotPolynomial):
        fit([(2, 100), (3, 150), (4, 201)])


def test_upper_envelope():
    # A = 1000 + b, B = 10 + 100 b, C = 500 + 2 b, D = 200 b.  At b = 2 A wins (1002).
    # D catches A when 200 b >= 1000 + b, i.e. b >= 1000/199 -> b = 6 (1200 > 1006), and
    # from there D grows fastest.  B (which would catch A at b = 10) and C are never the max.
    lines = [Poly((1000, 1)), Poly((10, 100)), Poly((500, 2)), Poly((0, 200))]
    assert nondominated(lines, 2, None) == [0, 3]
    # Bounded above at b = 5: only the flat line is ever the maximum.
    assert nondominated(lines, 2, 5) == [0]


def test_max_fitting_linear_is_exact():
    lines = [Poly((1000, 1)), Poly((0, 200))]
    # peak(b) = max(1000 + b, 200 b); budget 2000: 200 b <= 2000 -> b <= 10; 1000 + b <= 2000 -> b <= 1000.
    assert max_fitting(lines, 2000, 2, None) == 10
    assert max_fitting(lines, 999, 2, None) == 1  # nothing fits: lo - 1
    assert max_fitting(lines, 10**6, 2, 64) == 64  # capped by the valid range


def test_max_fitting_quadratic_by_bisection():
    quad = [Poly((0, 0, 1))]  # b**2
    assert max_fitting(quad, 10_000, 2, None) == 100
    assert max_fitting(quad, 10_000 - 1, 2, None) == 99
