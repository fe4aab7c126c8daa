"""Collectives on the CPU: gloo's buffers beyond a collective's output.

The capture runs a job's collectives on a fake process group (nothing is sent, the outputs are
what the caller allocated); the CPU target runs them on gloo
(torch/csrc/distributed/c10d/ProcessGroupGloo.cpp), which allocates around them:

- ``_allgather_base`` (``dist.all_gather_into_tensor``; FSDP2's all-gather of a unit's shards;
  the functional ``all_gather_into_tensor`` of DTensor's redistributions calls it too)
  hands ``allgather`` the output's chunks; ``AsyncAllgatherWork::allgather`` gathers into a
  single flat tensor like the outputs (``newLikeFlat``: the output's bytes) and copies it out.
- ``_reduce_scatter_base`` (``dist.reduce_scatter_tensor``; FSDP2's gradient reduce-scatter; the
  functional ``reduce_scatter_tensor`` of sequence parallelism):
  ``reduce_scatter_tensor_coalesced`` all-reduces a clone of the input (its bytes), then copies
  the rank's chunk into the output.  With ``ReduceOp.AVG`` gloo's all-reduce divides that clone
  in place by the world size (``AsyncAllreduceWork``: ``tensor /= size``): a wrapped double
  (8 B) and its copy in the tensor's dtype (TensorIterator), none for double.

Each buffer lives while the collective runs (a gloo worker thread; the caller waits on it
before the buffers' results are read): scratch of the op.  Measured on real gloo jobs by
``validators.distributed`` (FSDP2, fp32: all-gather +output bytes, reduce-scatter +input bytes
+ 12 B).
"""

from __future__ import annotations

import torch

from estimator.corrections.registry import Fix, correction, nbytes
from estimator.vocab.categories import Target

_AVG = 1  # c10d ReduceOp.RedOpType.AVG (torch/csrc/distributed/c10d/Types.hpp)
_WIDE = (torch.float64, torch.int64)  # no copy of the wrapped double


def _op(namespace: str, name: str):
    return getattr(getattr(getattr(torch.ops, namespace, None), name, None), "default", None)


_ALLGATHER, _REDUCE_SCATTER = _op("c10d", "_allgather_base_"), _op("c10d", "_reduce_scatter_base_")
_FUNCTIONAL_ALLGATHER = _op("_c10d_functional", "all_gather_into_tensor")
_FUNCTIONAL_REDUCE_SCATTER = _op("_c10d_functional", "reduce_scatter_tensor")


def _avg_scalars(t: torch.Tensor, avg: bool) -> int:
    """The wrapped number of gloo's in-place AVG division, and its copy in ``t``'s dtype."""
    return 8 + (0 if t.dtype in _WIDE else t.element_size()) if avg else 0


if _ALLGATHER is not None:  # a torch built without torch.distributed has no c10d ops
    @correction(_ALLGATHER, targets=Target.CPU)
    def gloo_all_gather(args, kwargs, out) -> Fix:
        """The flat output gloo gathers into: the output's bytes."""
        return Fix(scratch=(nbytes(args[0]),))

    @correction(_FUNCTIONAL_ALLGATHER, targets=Target.CPU)
    def gloo_functional_all_gather(args, kwargs, out) -> Fix:
        """As ``_allgather_base``, into the output the op returns."""
        return Fix(scratch=(nbytes(out),))

    @correction(_REDUCE_SCATTER, targets=Target.CPU)
    def gloo_reduce_scatter(args, kwargs, out) -> Fix:
        """The clone of the input gloo all-reduces (its bytes), and AVG's scalars on top."""
        _output, inputs, _group, reduce_op = args[:4]
        op = getattr(reduce_op, "op", None)
        return Fix(scratch=(nbytes(inputs) + _avg_scalars(inputs, op is not None and op() == _AVG),))

    @correction(_FUNCTIONAL_REDUCE_SCATTER, targets=Target.CPU)
    def gloo_functional_reduce_scatter(args, kwargs, out) -> Fix:
        """As ``_reduce_scatter_base``; the reduce op is named (``"avg"``)."""
        inputs, reduce_op = args[:2]
        return Fix(scratch=(nbytes(inputs) + _avg_scalars(inputs, str(reduce_op).lower() == "avg"),))
