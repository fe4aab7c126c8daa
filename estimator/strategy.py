"""How the step is spread over time (and, later, devices): ``Strategy``.

Single-process settings so far:

- ``accumulate=k``: gradient accumulation over ``k`` micro-batches.  The batch ``b`` given to
  ``report``/``Report.at`` is the batch of one optimizer step; each micro-step runs ``b / k``
  samples (``b`` must be a multiple of ``k``).  The step (``estimator.step.train_step``)::

      for micro in chunks(sample, k):        # views of the full batch, which stays alive
          out = model(micro); loss = loss_fn(out, micro) / k
          loss.backward()                    # the 2nd and later ones add into .grad
      optimizer.step(); optimizer.zero_grad(set_to_none=True)

- ``checkpoint``: activation checkpointing of modules, by path (``"transformer.h.0"``), glob
  (``"transformer.h.*"``), a tuple of those, or a module type (``Block``: every instance).
  Their forward runs inside ``torch.utils.checkpoint.checkpoint(..., use_reentrant=
  checkpoint_reentrant)`` and is recomputed in backward.

Data, tensor and pipeline parallelism and sharded optimizers (ZeRO/FSDP) are meant to be
further fields of the same dataclass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fnmatch
import functools
from collections.abc import Iterator

import torch
from torch import nn

from estimator.errors import InputError


@dataclasses.dataclass(frozen=True)
class Strategy:
    """The training strategy: ``accumulate`` micro-batches per optimizer step, and the modules
    whose activations are checkpointed (recomputed in backward)."""

    accumulate: int = 1
    checkpoint: tuple[str, ...] | str | type | None = None
    checkpoint_reentrant: bool = False

    def __post_init__(self) -> None:
        k = self.accumulate
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InputError(f"Strategy(accumulate=) must be a positive int (micro-batches per step), got {k!r}")
        ckpt = self.checkpoint
        if isinstance(ckpt, list):
            object.__setattr__(self, "checkpoint", ckpt := tuple(ckpt))
        valid = (
            ckpt is None
            or isinstance(ckpt, str)
            or (isinstance(ckpt, type) and issubclass(ckpt, nn.Module))
            or (isinstance(ckpt, tuple) and ckpt and all(isinstance(p, str) for p in ckpt))
        )
        if not valid:
            raise InputError(
                "Strategy(checkpoint=) must be a module path or glob ('transformer.h.*'), a tuple of them, "
                f"or an nn.Module subclass, got {ckpt!r}"
            )
        if not isinstance(self.checkpoint_reentrant, bool):
            raise InputError(f"Strategy(checkpoint_reentrant=) must be True or False, got {self.checkpoint_reentrant!r}")

    @property
    def is_default(self) -> bool:
        return self.accumulate == 1 and self.checkpoint is None

    def check_batch(self, batch: int) -> None:
        """``batch`` must split into ``accumulate`` equal micro-batches."""
        if batch % self.accumulate:
            raise InputError(
                f"Strategy(accumulate={self.accumulate}) needs a batch size that is a multiple of "
                f"{self.accumulate}, got b={batch}"
            )

    def checkpointed(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The ``(path, module)`` pairs selected by ``checkpoint`` (outermost only: a selected
        module inside another selected one is recomputed with it)."""
        if self.checkpoint is None:
            return []
        named = list(model.named_modules())
        if isinstance(self.checkpoint, type):
            found = [(p, m) for p, m in named if isinstance(m, self.checkpoint)]
            if not found:
                types = sorted({type(m).__name__ for _, m in named})
                raise InputError(
                    f"Strategy(checkpoint={self.checkpoint.__name__}): the model has no instance of it "
                    f"(its module types: {', '.join(types)})"
                )
        else:
            patterns = (self.checkpoint,) if isinstance(self.checkpoint, str) else self.checkpoint
            paths = [p for p, _ in named if p]
            found = []
            for pattern in patterns:
                hits = [(p, m) for p, m in named if p and fnmatch.fnmatchcase(p, pattern)]
                if not hits:
                    close = difflib.get_close_matches(pattern, paths, n=3)
                    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
                    raise InputError(f"Strategy(checkpoint=): the model has no module {pattern!r}{hint}")
                found += hits
        found = list({id(m): (p, m) for p, m in found}.values())
        return [(p, m) for p, m in found if not any(p.startswith(q + ".") for q, _ in found)]


DEFAULT = Strategy()


@contextlib.contextmanager
def checkpointing(model: nn.Module, strategy: Strategy) -> Iterator[None]:
    """Run the selected modules' forward under ``torch.utils.checkpoint.checkpoint`` (an
    instance attribute ``forward`` shadowing the class's, removed on exit)."""
    selected = strategy.checkpointed(model)
    saved = []
    for _, module in selected:
        had = "forward" in vars(module)
        saved.append((module, had, vars(module).get("forward")))
        module.forward = functools.partial(_checkpointed, module.forward, strategy.checkpoint_reentrant)
    try:
        yield
    finally:
        for module, had, forward in saved:
            if had:
                module.forward = forward
            else:
                del module.forward


def _checkpointed(forward, reentrant: bool, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if reentrant:  # the reentrant variant takes no keyword arguments
        return torch.utils.checkpoint.checkpoint(
            functools.partial(forward, **kwargs) if kwargs else forward, *args, use_reentrant=True
        )
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


@functools.cache
def _accumulated_report():
    from estimator.report.result import Report

    @dataclasses.dataclass(frozen=True)
    class AccumulatedReport(Report):
        """A ``Report`` of a step accumulating ``accumulate`` micro-batches: ``b`` must be a
        multiple of it (``at``), and ``max_batch`` is the largest such multiple that fits."""

        accumulate: int = 1

        def _check_range(self, b: int, s: int | None = None) -> None:
            if isinstance(b, int) and not isinstance(b, bool) and b % self.accumulate:
                raise InputError(
                    f"this step accumulates {self.accumulate} micro-batches: b must be a multiple of "
                    f"{self.accumulate}, got b={b}"
                )
            super()._check_range(b, s)

        def max_batch(self, budget=None, s=None) -> int:
            # The plain report's answer (its CUDA bisection evaluates every b), rounded down to
            # a multiple of ``accumulate``: memory grows with b, so that multiple fits too.
            plain = Report(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Report)})
            best = plain.max_batch(budget, s)
            best -= best % self.accumulate
            return best if best >= self.valid_from else 0

    return AccumulatedReport


def report_type(strategy: Strategy):
    """The ``Report`` class for ``strategy`` (with the divisibility checks when accumulating)."""
    if strategy.accumulate == 1:
        from estimator.report.result import Report

        return Report
    return _accumulated_report()
