"""Captures kept for the process (``orchestrate.reuse``) and captured in worker processes
(``orchestrate.workers``): a kept or worker-made formula gives the report a capture here gives,
and any change a capture would see captures again."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from torch import nn

import estimator
from estimator import InputError, Strategy
from estimator.orchestrate import reuse, workers
from estimator.orchestrate.checked import check
from estimator.vocab.request import Request


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.scale = 1.0

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x)) * self.scale
        return x


def _plain(rep):
    """A report without its fx graph (a kept formula's graph is the same object; a worker's is a
    copy, compared by its nodes elsewhere)."""
    return dataclasses.replace(rep, graph=None, ranks=tuple(dataclasses.replace(r, report=_plain(r.report))
                                                             for r in rep.ranks))


def test_a_second_report_of_the_same_step_reuses_its_capture(captures):
    model = Net()
    first = estimator.report(model, torch.randn(8, 64), device="cpu")
    again = estimator.report(model, torch.randn(8, 64), device="cpu")  # new sample tensors, same layout
    assert len(captures) == 1 and _plain(again) == _plain(first)
    # another batch inside the symbolic formula's range: the same formula, evaluated there
    other = estimator.report(model, torch.randn(5, 64), device="cpu")
    assert len(captures) == 1 and first.valid_from <= 5
    estimator.forget_captures()
    assert _plain(estimator.report(model, torch.randn(5, 64), device="cpu")) == _plain(other)
    assert len(captures) == 2


@pytest.mark.parametrize("change", [
    lambda m: m.blocks[0].weight.requires_grad_(False),  # a frozen layer: no gradient, no Adam state
    lambda m: setattr(m, "scale", 2.0),  # a setting the forward reads
    lambda m: m.blocks.append(nn.Linear(64, 64)),  # a module more
    lambda m: m.blocks[1].register_forward_hook(lambda *_: None),  # a hook
    lambda m: m.to(torch.bfloat16),  # other dtypes
], ids=["requires_grad", "setting", "module", "hook", "dtype"])
def test_a_change_the_capture_would_see_captures_again(captures, change):
    model = Net()
    estimator.report(model, torch.randn(8, 64), device="cpu")
    change(model)
    dtype = next(model.parameters()).dtype
    estimator.report(model, torch.randn(8, 64, dtype=dtype), device="cpu")
    assert len(captures) == 2


def test_other_steps_options_and_samples_are_other_captures(captures):
    model = Net()
    estimator.report(model, torch.randn(8, 64), device="cpu")
    estimator.report(model, torch.randn(8, 64), device="cpu", optimizer="sgd")
    estimator.report(model, torch.randn(8, 64), device="cpu", strategy=Strategy(checkpoint=nn.Linear))
    estimator.report(model, torch.randn(8, 64), device="cuda")
    estimator.report(model, torch.randn(8, 64), device="cpu", mode="inference")
    estimator.report(model, torch.zeros(8, 64), device="cpu")
    assert len(captures) == 5  # the last: the first's layout (values count only under data_dependent="sample")
    estimator.report(Net(), torch.randn(8, 64), device="cpu")  # another model object
    assert len(captures) == 6


def test_a_capture_that_read_values_is_kept_for_those_values(captures):
    """A Python branch on the sample's values (``x.sum() > 0``): the capture read them, so it is
    reused only for the same tensors at the same versions (an in-place write is another run)."""
    class Branches(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(16, 4)

        def forward(self, x):
            return self.l(x) if (x.sum() > 0).item() else -self.l(x)

    model, x = Branches(), torch.rand(8, 16)
    first = estimator.report(model, x, mode="inference", device="cpu")
    estimator.report(model, x, mode="inference", device="cpu")
    assert len(captures) == 1
    x.neg_()  # the other branch: one more output
    assert estimator.report(model, x, mode="inference", device="cpu").peak_bytes > first.peak_bytes
    estimator.report(model, torch.rand(8, 16), mode="inference", device="cpu")  # other tensors
    assert len(captures) == 3


def test_a_key_whose_model_died_is_dropped():
    model = Net()
    key = reuse.key(check(Request(model, torch.randn(8, 64), device="cpu")))
    assert key.alive()
    del model
    gc.collect()
    assert not key.alive()


def test_registering_an_op_captures_again(captures):
    """A declared op (``register_op``) changes what the capture records: part of the key."""
    from estimator.corrections import custom_ops

    model = Net()
    estimator.report(model, torch.randn(8, 64), device="cpu")
    lib = torch.library.Library("fxmem_reuse_test", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    try:
        estimator.register_op("fxmem_reuse_test::twice", outputs=lambda x: torch.empty_like(x))
        estimator.report(model, torch.randn(8, 64), device="cpu")
        assert len(captures) == 2
    finally:
        custom_ops.unregister_op("fxmem_reuse_test::twice")
        lib._destroy()


def test_compare_in_worker_processes_is_compare_here(tmp_path, monkeypatch, captures):
    """The CPU target, kernels measured in the workers (an empty kernel cache), after this
    process ran parallel kernels (GNU OpenMP's pool, which fork does not copy): every row equals
    the one captured here."""
    monkeypatch.setenv("FXMEM_CACHE_DIR", str(tmp_path / "parallel"))
    model, x = Net(), torch.randn(8, 64)
    torch.randn(1 << 20).exp_().sum()  # a parallel region in this process
    strategies = {"single": Strategy(), "bf16": Strategy(amp="bf16"), "ckpt": Strategy(checkpoint=nn.Linear),
                  "pipeline": Strategy(pipeline=2)}
    parallel = estimator.compare(model, x, 8, strategies, device="cpu", workers=2)
    assert captures == []  # every step was captured in a worker
    estimator.forget_captures()
    monkeypatch.setenv("FXMEM_CACHE_DIR", str(tmp_path / "here"))
    here = estimator.compare(model, x, 8, strategies, device="cpu", workers=1)
    assert len(captures) == 3
    assert [_plain(r.report) for r in parallel.rows] == [_plain(r.report) for r in here.rows]
    graphs = [[(n.op, n.name, str(n.target), n.meta.get("tensor_meta")) for n in r.report.graph.nodes]
              for r in (parallel.rows[0], here.rows[0])]
    assert graphs[0] == graphs[1]


def test_a_capture_that_fails_in_a_worker_raises_here(captures):
    """A worker's failure is left to this process, which captures again and raises as a report does."""
    def bad_loss(out, sample):
        raise ValueError("this loss always fails")

    raised = []
    for n in (2, 1):
        with pytest.raises(Exception, match="this loss always fails") as info:
            estimator.compare(Net(), torch.randn(8, 64), 8, [Strategy(), Strategy(amp="bf16")], device="cpu",
                              loss_fn=bad_loss, optimizers={}, workers=n)
        raised.append(type(info.value))
    assert raised[0] is raised[1] and len(captures) == 2  # one here per compare: the first row raised


def test_workers_must_be_a_whole_number():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(InputError, match="workers must be a whole number"):
            estimator.compare(Net(), torch.randn(8, 64), 8, [Strategy()], device="cpu", workers=bad)
    assert workers.workers_for(None, 1) == 1 and workers.workers_for(8, 3) in (1, 3)
