"""Shared fixtures of the fxmem test suite (markers are declared in pyproject.toml too)."""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import warnings

import pytest
import torch


def pytest_configure(config):
    # CPU kernels measured on the host are cached: the suite measures into a cache of its own
    # (subprocess tests inherit it), so a stale user cache cannot hide a regression.
    os.environ.setdefault("FXMEM_CACHE_DIR", tempfile.mkdtemp(prefix="fxmem-test-cache-"))
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped where none is available)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    # the suite keeps its objects frozen between tests (``_old_objects_frozen``): captures leave them so
    from estimator.vocab import bookkeeping

    bookkeeping.keep_frozen()
    # torch is imported without numpy in this venv; its one-time warning is noise.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


MAX_WORKERS = 4  # each worker imports torch and captures models of its own: about 1-3 GiB each


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject's addopts): one worker per core this process may run on, at most
    ``MAX_WORKERS``."""
    from estimator.orchestrate.workers import usable_cores

    return min(usable_cores(), MAX_WORKERS)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _old_objects_frozen():
    """Collect what earlier tests left, then move every surviving object to the collector's
    permanent generation (``gc.freeze``): the ``gc.collect()`` every measurement makes
    (validators.steady.warm_up, validators.cpu, estimator.capture.trace) then walks only this
    test's objects, not the whole session's (torch's fake-tensor dispatch cache, cached reports:
    over a million objects, ~1 s per collection late in the suite).  A test's own garbage is still
    collected as before; only objects alive when a test starts are never collected as cycles.
    Captures leave them frozen (``bookkeeping.keep_frozen``, set in ``pytest_configure``)."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(autouse=True)
def _no_bitsandbytes_overrides():
    """bitsandbytes' ``GlobalOptimManager`` is one per process: a real ``Trainer`` with an 8-bit
    optimizer registers 32-bit overrides in it, which every later 8-bit optimizer of the process
    reads by parameter position.  Each test starts without them, as a new process does."""
    module = sys.modules.get("bitsandbytes.optim.optimizer")
    if module is not None:
        module.GlobalOptimManager.get_instance().initialize()
    yield


@pytest.fixture(autouse=True)
def _seeded():
    """Every test builds its models from the same RNG state (values never change bytes, but
    reproducible failures are easier to read)."""
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_kept_captures():
    """Each test captures its own steps: nothing kept from an earlier test's reports
    (``orchestrate.reuse``; tests/test_reuse.py tests the keeping)."""
    from estimator.orchestrate import reuse

    reuse.forget_captures()
    yield


@pytest.fixture
def captures(monkeypatch) -> list:
    """The captures run in this process (the strategy of each), counted: a test asks for it to
    see which reports captured and which reused a kept step or a worker's."""
    from estimator.orchestrate import path

    calls = []
    original = path.formula

    def counting(model, sample, spec, *args):
        calls.append(spec.strategy)
        return original(model, sample, spec, *args)

    monkeypatch.setattr(path, "formula", counting)
    return calls
