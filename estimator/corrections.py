"""Per-op corrections: memory the fake run does not see, or sees wrongly.

One registry, filled by ``@correction(op)``; a second registration of the same op raises.
Each entry cites where its number comes from (a PyTorch source file and/or a measurement
command).  A correction function receives the op's arguments and outputs (fake tensors, shapes
possibly symbolic) and returns a ``Fix``:

- ``output_bytes[i]``: bytes the real kernel's i-th tensor output holds beyond what the meta
  kernel reports (it lives and dies with that output's storage);
- ``transient_bytes``: kernel-internal scratch alive only while the op runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

aten = torch.ops.aten


@dataclass(frozen=True)
class Fix:
    output_bytes: dict[int, Any] = field(default_factory=dict)
    transient_bytes: Any = 0


NO_FIX = Fix()
CorrectionFn = Callable[..., Fix]
_REGISTRY: dict[Any, CorrectionFn] = {}


def correction(*ops) -> Callable[[CorrectionFn], CorrectionFn]:
    """Register ``fn(args, kwargs, out) -> Fix`` for each aten overload (or packet) in ``ops``."""

    def register(fn: CorrectionFn) -> CorrectionFn:
        for op in ops:
            overloads = [getattr(op, name) for name in op.overloads()] if hasattr(op, "overloads") else [op]
            for overload in overloads:
                if overload in _REGISTRY:
                    raise ValueError(f"a correction for {overload} is already registered")
                _REGISTRY[overload] = fn
        return fn

    return register


def lookup(func, args, kwargs, out) -> Fix:
    fn = _REGISTRY.get(func)
    return NO_FIX if fn is None else fn(args, kwargs, out)


def registered() -> dict[Any, CorrectionFn]:
    """A copy of the registry (op overload -> correction function)."""
    return dict(_REGISTRY)
