"""CUDA target entries.  Each module lists what it cannot model without a device in
``NOT_MODELLED``: ``Gap``s, each with the aten ops it concerns."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Gap:
    """Something the CUDA target does not model, and the ops (fragments of their aten names) it
    concerns: it applies to a step that ran one of them (every step where ``ops`` is empty)."""

    text: str
    ops: tuple[str, ...] = ()

    def applies(self, ran: Iterable[str]) -> bool:
        return not self.ops or any(fragment in name for name in ran for fragment in self.ops)


def not_modelled(ran: Iterable[str] | None = None) -> tuple[str, ...]:
    """The gaps that apply to a step that ran the aten ops ``ran`` (None: every gap)."""
    from estimator.corrections.cuda import attention_substitute, autocast, kernels, optim, pooling, rnn

    ran = None if ran is None else set(ran)
    modules = (attention_substitute, autocast, kernels, pooling, optim, rnn)
    gaps = (gap for module in modules for gap in getattr(module, "NOT_MODELLED", ()))
    return tuple(gap.text for gap in gaps if ran is None or gap.applies(ran))
