"""Notes for a step without a steady state: one that holds more after it returns than before it
started (a user's step that appends to a list), or a model whose memory grows with every step
(a buffer or a list of tensors added to in ``forward``)."""

from __future__ import annotations

import gc

import sympy
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from estimator.capture import phases
from estimator.capture.fake import RealTensors
from estimator.capture.tracker import Storage, Tracker
from estimator.capture.watchdog import Watchdog


def step_growth(tracker: Tracker, shape_env: ShapeEnv | None) -> tuple[str, ...]:
    """A note when a user's step holds more once it returned than before it started (its result
    dropped): what it allocated and keeps (a list of losses it appends to) minus the state it
    freed.  There is then no steady state: every later step starts higher."""
    gc.collect()
    alive = tracker.alive_keys()
    known = {} if shape_env is None else (getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val)

    def nbytes(s: Storage) -> int:
        return int(sympy.sympify(s.nbytes).xreplace(known)) + int(sympy.sympify(s.extra).xreplace(known))

    kept = [s for key, s in tracker.storages.items() if s.op >= 0 and key in alive]
    freed = [s for key, s in tracker.storages.items() if s.op < 0 and key not in alive]
    grown = sum(map(nbytes, kept)) - sum(map(nbytes, freed))
    if grown <= 0:
        return ()
    ops = ", ".join(dict.fromkeys(tracker.ops[s.op].name for s in kept))
    return (f"your step holds {grown:,} B more when it returns than when it started (at the capture's batch; "
            f"allocated by {ops} and still referenced: a list it appends to?). There is no steady state: this is "
            "the next step's peak, and every later step starts that much higher",)


def growth_note(model: nn.Module, run_step, mode: FakeTensorMode, real: RealTensors, before: dict[str, int],
                after: dict[str, int], batch: int) -> tuple[str, ...]:
    """A note when the model holds more after each step than before it (a buffer or a list of
    tensors appended to in ``forward``): no steady state.  The measured step was the fake
    model's first, so state it created once (a cache) also looks like growth: only then is one
    more step (``run_step()``) run, not recorded, to see whether it grows again."""
    if sum(after.values()) <= sum(before.values()):
        return ()
    real.tracker = None  # the capture is over: tensors met now are not memory of the step
    try:
        with Watchdog(), mode, real:
            result = run_step()
            del result
    except Exception:  # the step cannot be repeated without the capture's modes: cannot tell
        return ()
    again = phases.model_state(model)
    grown = sum(again.values()) - sum(after.values())
    if grown <= 0:
        return ()
    names = [name for name, n in again.items() if n > after.get(name, 0)]
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return (f"the model's memory grows with every step: it holds {grown:,} B more after each step at b = {batch} "
            f"({shown}: a buffer or a list of tensors added to in forward). There is no steady state: this "
            "estimate is for the next step from the model as given, and every later step holds more",)
