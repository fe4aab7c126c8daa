"""Per-op corrections: memory the fake run does not see, or sees wrongly.

One registry, filled by ``@correction(op)``; a second registration of the same op raises.
Each entry cites where its number comes from (a PyTorch source file and/or a measurement
command).  A correction function receives the op's arguments and outputs (fake tensors, shapes
possibly symbolic) and returns a ``Fix``:

- ``output_bytes[i]``: bytes the real kernel's i-th tensor output holds beyond what the meta
  kernel reports (it lives and dies with that output's storage);
- ``scratch``: kernel-internal memory alive only while the op runs, as the extra bytes at
  each local maximum inside the kernel, relative to "inputs and outputs alive".  Several
  values because which one is largest can depend on ``b``; each becomes a candidate peak.
- ``outputs``: replacement outputs, for a fake kernel whose outputs alias where the real
  kernel's do not (the aliasing changes what autograd copies); None keeps them.

Values are ints or sympy expressions: convert shapes with ``estimator.capture.tracker.as_expr``
and compute with sympy, never with SymInts (the arithmetic would be traced, and a Python
comparison would add a shape guard).
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
    scratch: tuple[Any, ...] = ()
    outputs: Any = None


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


def bind(func, args, kwargs) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in (no positional magic indexes)."""
    bound = {}
    for i, argument in enumerate(func._schema.arguments):
        if i < len(args):
            bound[argument.name] = args[i]
        else:
            bound[argument.name] = kwargs.get(argument.name, argument.default_value)
    return bound


def lookup(func, args, kwargs, out) -> Fix:
    fn = _REGISTRY.get(func)
    fix = NO_FIX if fn is None else fn(args, kwargs, out)
    wrapped = _wrapped_scalar_bytes(func, args, out)
    if wrapped:
        # Alive for the whole op: on top of every in-kernel peak, and a peak of its own.
        fix = Fix(fix.output_bytes, (wrapped, *(s + wrapped for s in fix.scratch)), fix.outputs)
    return fix


_TENSOR_POSITIONS: dict[Any, tuple[int, ...]] = {}
_WIDE = (torch.float64, torch.int64)  # the dtypes Python numbers are wrapped in


def _wrapped_scalar_bytes(func, args, out) -> int:
    """The one rule that is not per-op: a Python number passed where the schema says Tensor
    (``aten.div.Tensor(t, 0.5)``) is wrapped into a 0-dim double/int64 tensor (8 B,
    ``scalar_to_tensor`` in aten/src/ATen/ScalarOps.h) and TensorIterator copies it to the
    result's dtype (``itemsize`` B unless that is double/int64).  Measured: ``x / 0.5`` on
    fp32 allocates 8 + 4 B besides its output; on bf16 8 + 2; on fp64 8.
    """
    positions = _TENSOR_POSITIONS.get(func)
    if positions is None:
        positions = tuple(
            i for i, a in enumerate(func._schema.arguments) if isinstance(a.type, torch.TensorType)
        )
        _TENSOR_POSITIONS[func] = positions
    count = sum(1 for i in positions if i < len(args) and type(args[i]) in (int, float))
    if not count or not isinstance(out, torch.Tensor):
        return 0
    return count * (8 + (0 if out.dtype in _WIDE else out.element_size()))


def registered() -> dict[Any, CorrectionFn]:
    """A copy of the registry (op overload -> correction function)."""
    return dict(_REGISTRY)
