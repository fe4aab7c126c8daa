"""Results that several test files ask for, computed once per test session (suite time).

The same validation row or zoo capture requested by two files (tests/test_validation.py and
tests/test_fastpath.py's fast-path rows, tests/test_symbolic.py and tests/test_events.py's
reports) is computed by whichever file runs first and reused by the other; each file run on its
own still computes everything it asserts on.  Rows and reports are frozen dataclasses: a test
cannot change what another one sees.
"""

from __future__ import annotations

import functools

import estimator
import models_zoo
from validators import zoo


def compare(name: str, size: str, mode: str, batch: int, dtype: str = "fp32") -> zoo.Row:
    """``validators.zoo.compare``: one prediction and one CPU measurement, each on a fresh model."""
    return _compare(name, size, mode, batch, dtype)


@functools.cache
def _compare(name: str, size: str, mode: str, batch: int, dtype: str) -> zoo.Row:
    return zoo.compare(name, size, mode, batch, dtype)


@functools.cache
def zoo_report(name: str, mode: str, batch: int) -> estimator.Report:
    """Zoo model ``name`` (``debug``) captured from a sample of 8 rows for ``batch``: AdamW, the
    model's own loss (a batch outside the formula's range is captured again at ``batch``)."""
    model, make_sample, loss_fn = models_zoo.get(name, "debug")
    return estimator.report(model, make_sample(8), batch=batch, mode=mode, optimizer="adamw", loss_fn=loss_fn,
                            device="cpu")
