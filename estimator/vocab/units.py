"""Byte quantities: parsing budgets ("80GiB", "40 GB") and rendering sizes.

Inside fxmem everything is an integer number of bytes; units appear only here.
"""

from __future__ import annotations

import math
import numbers
import re

from estimator.vocab.errors import InputError

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40
_UNITS = {
    "": 1, "b": 1,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": KiB, "m": MiB, "g": GiB, "t": TiB,
}
_BUDGET = re.compile(r"^\s*([+-]?\s*[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: float | str) -> int:
    """Bytes from an int or a string such as ``"80GiB"``, ``"40 GB"``, ``"512MiB"``.

    GiB/MiB are powers of two, GB/MB powers of ten, a bare ``G``/``M`` is taken as GiB/MiB.

    >>> parse_bytes("1.5 GiB")
    1610612736
    """
    if isinstance(value, bool):
        raise InputError(f"budget must be bytes or a string like '80GiB', got {value!r}")
    if isinstance(value, numbers.Real):  # int, float, numpy scalars
        number, factor = float(value), 1
    elif isinstance(value, str):
        match = _BUDGET.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise InputError(
                f"cannot parse the memory size {value!r}: write a number and a unit, "
                "e.g. '80GiB', '40 GB', '512MiB' or a plain number of bytes"
            )
        number, factor = float(match.group(1).replace(" ", "")), _UNITS[unit]
    else:
        raise InputError(f"budget must be bytes or a string like '80GiB', got {type(value).__name__}")
    if not math.isfinite(number):
        raise InputError(f"a memory size must be a finite number of bytes, got {value!r}")
    if number <= 0:
        raise InputError(f"a memory size must be positive, got {value!r}")
    return int(number * factor)


def as_int(value, what: str, minimum: int = 1) -> int:
    """``value`` as an ``int`` if it is an integer (``numbers.Integral``: ``int``, ``numpy.int64``…,
    not ``bool``) of at least ``minimum``; else ``InputError`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise InputError(f"{what} must be {kind}, got {value!r}")
    return int(value)


def format_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'``; exact bytes below 1 KiB."""
    n = float(n)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
