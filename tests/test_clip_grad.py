"""Gradient clipping and ``zero_grad(set_to_none=False)`` in a user's step (``report(step=fn)``).

CPU target: the estimate against the real step measured by the CPU profiler
(``validators.cpu.measure_user_step``), exact to the byte (tolerance 0 B), each pair predicted and
measured under ``validators.cpu.threads(1)``; and the capture runs the clipping ops the real step
runs (``_foreach_norm`` where real gradients take the foreach branch: ``corrections/clip.py``).
CUDA target (no GPU: arithmetic from ForeachReduceOp.cu, shown in the comments): the per-chunk
buffer of ``_foreach_norm``, and the gradients kept by ``zero_grad(set_to_none=False)`` as state
before the steps.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import estimator
from estimator.account import allocation_events
from estimator.capture import steps
from estimator.vocab.categories import Category, Mode
from validators.cpu import measure_user_step, threads

CATEGORIES = list(Category)


def _mlp(dims=(64, 128, 128, 10), dtype=torch.float32) -> nn.Sequential:
    layers = []
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(dims) - 2 else [])
    return nn.Sequential(*layers).to(dtype)


def _sample(b=8, features=64, classes=10, dtype=torch.float32):
    return torch.randn(b, features, dtype=dtype), torch.randint(0, classes, (b,))


def _step(clip: str = "norm", foreach=None, norm_type=2.0, set_to_none=False):
    """A user's step: forward, loss, backward, clipping (``clip``: "norm", "value" or "none"),
    ``opt.step()``, ``opt.zero_grad(set_to_none=...)``."""

    def my_step(model, sample, opt):
        x, y = sample
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if clip == "norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=norm_type, foreach=foreach)
        elif clip == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.5, foreach=foreach)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)

    return my_step


def _op_names(rep) -> list[str]:
    return [op.op.split(".")[1] for op in rep.timeline.ops]


# --- CPU target: exact against the real step -------------------------------------------------

# aten ops whose number tells the foreach branch from the per-tensor loops (clip_grad.py,
# Optimizer.zero_grad); AdamW's for-loop step (the CPU default) adds mul_ of its own, the same
# in both runs.
WATCHED = {"_foreach_norm", "_foreach_mul_", "_foreach_clamp_min_", "_foreach_clamp_max_", "_foreach_zero_",
           "linalg_vector_norm", "stack", "mul_", "clamp_", "zero_"}


def _top_level_aten(prof) -> list[str]:
    """The aten ops the step called, not those called inside another aten op (CPU
    ``_foreach_norm`` runs one ``linalg_vector_norm`` per tensor inside itself)."""
    names, stack = [], [(node, False) for node in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, inside = stack.pop()
        aten = node.name.startswith("aten::")
        if aten and not inside:
            names.append(node.name.removeprefix("aten::"))
        stack.extend((child, inside or aten) for child in node.children)
    return names


def _real_ops(model, sample, fn, optimizer) -> Counter:
    """The watched aten ops of the second real step (the first one builds the steady state)."""
    state = steps.user_state(model, Mode.TRAIN, steps.state_factory(optimizer))
    fn(model, sample, state)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(model, sample, state)
    return Counter(name for name in _top_level_aten(prof) if name in WATCHED)


SGD_FOREACH = lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)  # noqa: E731

CPU_CASES = {
    "norm-foreach-None": (_step("norm", None), "adamw"),
    "norm-foreach-True": (_step("norm", True), "adamw"),
    "norm-foreach-False": (_step("norm", False), "adamw"),
    "norm-inf": (_step("norm", None, norm_type=math.inf), "adamw"),
    "value-foreach-None": (_step("value", None), "adamw"),
    "value-foreach-True": (_step("value", True), "adamw"),
    "value-foreach-False": (_step("value", False), "adamw"),
    "zero_grad-foreach-optimizer": (_step("norm", None), SGD_FOREACH),
    "zero_grad-only": (_step("none"), "adamw"),
}


@pytest.mark.parametrize("case", list(CPU_CASES))
def test_clipping_and_kept_gradients_are_exact_on_cpu(case):
    fn, optimizer = CPU_CASES[case]
    sample = _sample()
    with threads(1):
        rep = estimator.report(_mlp(), sample, step=fn, optimizer=optimizer, device="cpu")
        measured = measure_user_step(_mlp(), sample, fn, optimizer=optimizer)
        real = _real_ops(_mlp(), sample, fn, optimizer)
    assert rep.peak_bytes == measured.peak_bytes, (
        f"{case}: estimated {rep.peak_bytes:,} B, measured {measured.peak_bytes:,} B"
    )
    # zero_grad(set_to_none=False): the gradients are alive before the step, 4 B per parameter:
    # 64*128 + 128 + 128*128 + 128 + 128*10 + 10 = 26,122 floats = 104,488 B.
    assert rep.timeline.baseline[CATEGORIES.index(Category.GRADIENT)](8) == 104_488
    # The capture ran the clipping / zeroing branch the real step ran (CPU bytes are the same on
    # both branches, so only the ops tell: the CUDA target prices them differently).
    assert Counter(name for name in _op_names(rep) if name in WATCHED) == real


def test_foreach_none_clips_with_foreach_kernels_on_cpu():
    # clip_grad.py with foreach=None: _has_foreach_support holds for real CPU gradients (plain
    # tensors on "cpu"), so one _foreach_norm over the 6 gradients, one linalg_vector_norm of their
    # stack, one _foreach_mul_; a FakeTensor alone would fail the type test and loop 6 times.
    rep = estimator.report(_mlp(), _sample(), step=_step("norm", None), optimizer="adamw", device="cpu")
    names = Counter(_op_names(rep))
    assert (names["_foreach_norm"], names["linalg_vector_norm"], names["_foreach_mul_"]) == (1, 1, 1)
    # CPU _foreach_norm is foreach_tensor_norm_slow: no buffer besides its outputs.
    assert all(op.scratch == () for op in rep.timeline.ops if op.op == "aten._foreach_norm.Scalar")


def test_the_foreach_check_is_torchs_own_outside_a_capture():
    from torch.nn.utils import clip_grad
    from torch.utils import _foreach_utils

    estimator.report(_mlp(), _sample(), step=_step("norm", None), optimizer="adamw", device="cpu")
    assert clip_grad._has_foreach_support is _foreach_utils._has_foreach_support


# --- CUDA target: _foreach_norm's per-chunk buffer, kept gradients ------------------------------

# Linear(1000, 700), Linear(700, 50), Linear(50, 10): 6 gradients; the largest has 700 * 1000 =
# 700,000 elements = ceil(700,000 / 65,536) = 11 chunks of kChunkSize.
WIDE = (1000, 700, 50, 10)


def _cuda_report(fn, dtype=torch.float32, optimizer="adamw"):
    x, y = _sample(4, WIDE[0], WIDE[-1], dtype)
    return estimator.report(_mlp(WIDE, dtype), (x, y), step=fn, optimizer=optimizer, device="cuda", gpu="H100")


@pytest.mark.parametrize("dtype, opmath", [(torch.float32, 4), (torch.bfloat16, 4), (torch.float64, 8)])
def test_cuda_foreach_norm_books_one_partial_per_chunk(dtype, opmath):
    rep = _cuda_report(_step("norm", None), dtype)
    norms = [(i, op) for i, op in enumerate(rep.timeline.ops) if op.op == "aten._foreach_norm.Scalar"]
    assert len(norms) == 1
    index, op = norms[0]
    # output_per_tensor: ntensors * max_chunks_per_tensor opmath values (fp32 for fp32/bf16 outputs,
    # fp64 for fp64) = 6 * 11 * 4 = 264 B (fp64: 528 B), besides the 6 0-dim outputs.
    assert [s(4) for s in op.scratch] == [6 * 11 * opmath]
    # The allocator replay books it inside the op (a 512-byte block on the device).
    assert ("alloc", ("scratch", index), 6 * 11 * opmath) in list(allocation_events(rep.timeline, 4))


@pytest.mark.parametrize("norm_type", [1.0, math.inf])
def test_cuda_foreach_norm_fast_route_for_l1_and_inf(norm_type):
    rep = _cuda_report(_step("norm", None, norm_type=norm_type))
    scratch = [op.scratch for op in rep.timeline.ops if op.op == "aten._foreach_norm.Scalar"]
    assert [[s(4) for s in ss] for ss in scratch] == [[6 * 11 * 4]]


def test_cuda_foreach_norm_slow_route_and_the_loop_book_nothing():
    # ord 3 is not in {1, 2, inf}: foreach_tensor_norm_slow, one linalg_vector_norm per tensor.
    slow = _cuda_report(_step("norm", None, norm_type=3.0))
    assert [op.scratch for op in slow.timeline.ops if op.op == "aten._foreach_norm.Scalar"] == [()]
    # foreach=False: the per-tensor loop (6 norms + the total), no foreach kernel.
    loop = _cuda_report(_step("norm", False))
    names = Counter(_op_names(loop))
    assert (names["_foreach_norm"], names["linalg_vector_norm"], names["mul_"] >= 6) == (0, 7, True)


def test_cuda_clip_grad_value_is_foreach_and_in_place():
    rep = _cuda_report(_step("value", None))
    clamps = [op for op in rep.timeline.ops
              if op.op.startswith(("aten._foreach_clamp_min_", "aten._foreach_clamp_max_"))]
    assert len(clamps) == 2
    assert all(op.scratch == () and sum(p(4) for p in op.allocated) == 0 for op in clamps)


def test_cuda_kept_gradients_are_state_before_the_step():
    kept = _cuda_report(_step("norm", None, set_to_none=False))
    dropped = _cuda_report(_step("norm", None, set_to_none=True))
    # 4 B per parameter: 1000*700 + 700 + 700*50 + 50 + 50*10 + 10 = 736,260 floats = 2,945,040 B.
    grads = CATEGORIES.index(Category.GRADIENT)
    assert kept.timeline.baseline[grads](4) == 2_945_040
    assert dropped.timeline.baseline[grads](4) == 0
    # Every gradient storage exists before the first op and is never freed: the replay allocates
    # them with the parameters and optimizer state, before the step's first allocation.
    gradients = [s for s in kept.timeline.storages if s[1] is Category.GRADIENT]
    assert sum(s[0](4) for s in gradients) == 2_945_040
    assert all(s[2] == -1 and s[3] is None for s in gradients)
    before = sum(1 for s in kept.timeline.storages if s[2] == -1)
    events = list(allocation_events(kept.timeline, 4))[:before]
    assert all(kind == "alloc" and not isinstance(key, tuple) for kind, key, _ in events)
    grad_keys = {k for k, s in enumerate(kept.timeline.storages) if s[1] is Category.GRADIENT}
    assert {key for _, key, _ in events} >= grad_keys


def test_cuda_zero_grad_follows_the_optimizers_defaults():
    # Optimizer.zero_grad reads self.defaults["foreach"]: AdamW() (foreach=None, made foreach for
    # its step on CUDA in the param groups only) zeroes per gradient; AdamW(foreach=True) with one
    # _foreach_zero_.  Both in place.
    adamw_foreach = lambda m: torch.optim.AdamW(m.parameters(), foreach=True)  # noqa: E731
    per_tensor = Counter(_op_names(_cuda_report(_step("none"))))
    foreach = Counter(_op_names(_cuda_report(_step("none"), optimizer=adamw_foreach)))
    assert (per_tensor["zero_"], per_tensor["_foreach_zero_"]) == (6, 0)
    assert (foreach["zero_"], foreach["_foreach_zero_"]) == (0, 1)
