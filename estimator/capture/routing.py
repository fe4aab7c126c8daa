"""An MoE router's picks where no real run of the router can give them.

An MoE router picks each token's ``k`` experts with ``torch.topk`` over its scores, which follow
its weights.  Expert parallelism reads what follows from those picks -- each rank's token counts,
sent to the other ranks by an all-to-all, size what every rank receives -- so a capture needs their
values, which a real run on the sample gives (``datadep.probe``) where the weights are real.  On the
meta device there is none, and ``data_dependent="balanced"`` asks for a stated assumption instead:
a ``torch.topk`` whose input has no shadow (``shadows.py``) then gets ``picks`` as the shadow of its
indices, by the policy's ``Routing``:

- ``FIRST`` (the bound, what a capture on meta weights takes by default): every token picks experts
  ``0 … k-1``: with the experts split over the ranks in order (transformers' ``MoEParamShard``,
  torchtitan's expert parallelism), the first rank's experts receive every rank's tokens, the
  most any one rank can receive (another rank is that one when its experts are the favourites);
- ``BALANCED``: the ``(token, slot)`` pair ``p`` (row-major over the tokens and their ``k`` slots)
  picks expert ``p mod E``: every expert, and every rank, receives the same tokens up to one.

Each is the order ``torch.topk`` itself gives for scores that rank the experts so: a test router
built that way routes exactly as assumed (``validators/strategies.py`` ``PatternRouter``).
The picks are marked ``ROUTED``; values read from them are named in a note
(``value_notes.routed_note``).
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import _disable_current_modes

from estimator.capture.shadows import LIMIT, ROUTED, hint
from estimator.vocab.data_dependent import Routing


def picks(shape: tuple[int, ...], dim: int, experts: int, routing: Routing) -> torch.Tensor:
    """The indices ``torch.topk`` returns under ``routing``: ``shape`` is theirs (the scores' with
    ``dim`` of size ``k``), ``experts`` the scores' size along ``dim``."""
    dim = dim % len(shape)
    last = (*shape[:dim], *shape[dim + 1:], shape[dim])  # the picks' dim last
    k = shape[dim]
    if routing is Routing.BALANCED:
        chosen = torch.arange(torch.Size(last).numel(), dtype=torch.long).remainder_(experts).view(last)
    else:
        chosen = torch.arange(k, dtype=torch.long).expand(last)
    return chosen.movedim(-1, dim).contiguous()


def topk(mode, func, args, kwargs):
    """``aten.topk`` under ``datadep.DataDependent`` (``mode``): where the scores have no shadow,
    the indices get ``picks`` as theirs, marked ``ROUTED``, by the policy's ``routing``; without
    one the mode notes that such a top-k ran (``unrouted``)."""
    out = func(*args, **kwargs)
    routing = mode.policy.routing
    if mode.shadows.get(args[0]) is not None:
        return out
    if routing is None:
        mode.unrouted = True  # a value read after it may follow its picks (``NeedsProbe.after_topk``)
    else:
        scores, indices = args[0], out[1]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        shape = tuple(hint(s) for s in indices.shape)
        if all(isinstance(s, int) for s in shape) and math.prod(shape) <= LIMIT:
            with _disable_current_modes():  # a real tensor, not one of the capture's fakes
                chosen = picks(shape, dim, hint(scores.shape[dim]), routing)
            mode.shadows.seed(indices, chosen, mark=ROUTED)
    return out
