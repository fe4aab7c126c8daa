"""The one owner of fxmem's replacements of torch globals (``estimator.corrections.patches``)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import estimator
from estimator.corrections import patches
from estimator.corrections.patches import active, patched, patched_all

# What fxmem replaces while it runs (patches.py's table), as torch defines them.
ORIGINALS = {
    (torch.utils, "swap_tensors"): torch.utils.swap_tensors,
    (torch.overrides, "has_torch_function"): torch.overrides.has_torch_function,
    (F, "has_torch_function"): F.has_torch_function,
    (torch, "clear_autocast_cache"): torch.clear_autocast_cache,
    (torch.Tensor, "__format__"): torch.Tensor.__format__,
    (torch.amp.GradScaler, "_maybe_opt_step"): torch.amp.GradScaler._maybe_opt_step,
}


def test_restores_on_exit_and_on_error():
    owner = types.SimpleNamespace(f=1)
    with patched(owner, "f", 2):
        assert owner.f == 2 and active() == ["SimpleNamespace.f"]
    assert owner.f == 1 and active() == []
    with pytest.raises(RuntimeError), patched(owner, "f", 3):
        raise RuntimeError
    assert owner.f == 1 and active() == []


def test_nested_patches_restore_the_outer_value_first():
    owner = types.SimpleNamespace(f="torch's")
    with patched(owner, "f", "outer"):
        with patched(owner, "f", "inner"):
            assert owner.f == "inner"
        assert owner.f == "outer"  # not torch's yet: the outer block still runs
    assert owner.f == "torch's"


def test_an_inherited_attribute_is_inherited_again():
    class Base:
        def f(self):
            return "base"

    class Child(Base):
        pass

    with patched(Child, "f", lambda self: "patched"):
        assert Child().f() == "patched"
    assert "f" not in Child.__dict__ and Child().f() == "base"


def test_module_globals_and_reverse_order():
    module_globals = {"check": "torch's"}
    owner = types.SimpleNamespace(a=1, b=2)
    with patched_all([(module_globals, "check", "fake's"), (owner, "a", 10), (owner, "b", 20)]):
        assert module_globals["check"] == "fake's" and (owner.a, owner.b) == (10, 20)
        assert active() == ["dict.check", "SimpleNamespace.a", "SimpleNamespace.b"]
    assert module_globals == {"check": "torch's"} and (owner.a, owner.b) == (1, 2)


def _unchanged():
    assert patches.active() == []
    assert {key: getattr(*key) for key in ORIGINALS} == ORIGINALS
    # inherited from the C tensor, as before the capture
    assert not {"numpy", "to", "record_stream"} & set(torch.Tensor.__dict__)


def test_a_capture_leaves_torch_as_it_found_it():
    # CUDA with autocast and a GradScaler: the substitution mode, the emulated autocast, the
    # scaler's finite-gradient step and the conversions all patch something
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    estimator.report(model, torch.randn(4, 8), device="cuda", amp="fp16", grad_scaler=True)
    _unchanged()


def test_a_failed_capture_leaves_torch_as_it_found_it():
    class Fails(nn.Module):
        def forward(self, x):
            raise ValueError("the user's bug")

    with pytest.raises(estimator.FxmemError):
        estimator.report(Fails(), torch.randn(4, 8), device="cpu")
    _unchanged()
