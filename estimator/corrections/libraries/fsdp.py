"""FSDP2's own ops (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``).

``fsdp::chunk_cat`` (the reduce-scatter copy-in of a unit's gradients) calls
``torch._chunk_cat(tensors, dim, num_chunks, out=out)``.  On the CPU that is
``_chunk_cat_out`` (aten/src/ATen/native/TensorShape.cpp): ``_pad_chunk`` gives each tensor
whose ``dim`` does not divide by ``num_chunks`` a zero-padded copy (``new_zeros``, ``dim``
rounded up to a multiple) and reshapes each to ``(num_chunks, -1)`` (a copy where the tensor is
not contiguous), then ``cat_out`` writes them into ``out``: every copy is alive until the cat
ends, scratch of the op.  Where ``out``'s dtype is not the tensors' (bf16 gradients into an fp32
reduce-scatter input: ``MixedPrecisionPolicy(reduce_dtype=)``), the CPU cat copies each input,
one after the other, to a contiguous tensor of its own dtype first.  Measured (torch 2.13 CPU,
a (250, 250) weight's and a bias's gradients over 4 chunks): fp32 into fp32 252,000 + 1,008 B
together; bf16 into fp32 126,000 + 504 B, then 126,000 B on top and freed, then 504 B.  CUDA
has its own kernel (``_chunk_cat_cuda``: no copies).
"""

from __future__ import annotations

import weakref

import torch
from torch._subclasses import fake_tensor

from estimator.corrections.registry import Fix, bind, correction, nbytes
from estimator.vocab.categories import Target

# CPUOffloadPolicy(pin_memory=True): FSDPParam pins each sharded parameter when it shards it
# (``_fsdp_param.py``: ``padded_sharded_param.pin_memory()``), and fake tensors refuse ``_pin_memory``
# (``torch/_subclasses/fake_impls.py`` lists it among its "NYI" ops).  Pinning copies the tensor into a
# new page-locked host buffer of its size (``aten/src/ATen/native/Memory.cpp``, ``_pin_memory``:
# ``empty`` with the pinned allocator, then ``copy_``), and that buffer answers ``is_pinned()``
# true: FSDP2 pins only what is not pinned (``reset_sharded_param``, at the root's lazy init:
# ``if self.pin_memory and not local_tensor.is_pinned()``).  A fake tensor's ``is_pinned`` asks its
# meta storage (false), and fake tensors cache ops' answers by the arguments' shapes (a second
# ``_pin_memory`` of the same shape would make its buffer without this kernel): both are answered
# by fake tensors first, before their cache (``fake_tensor._DISPATCH_META_HANDLERS``).
_PINNED: dict[int, weakref.ref] = {}  # storage address -> weak reference, of the fake pinned buffers


def _pin_memory(args) -> torch.Tensor:
    out = torch.empty_like(args[0], memory_format=torch.contiguous_format)
    storage = out.untyped_storage()
    _PINNED[storage._cdata] = weakref.ref(storage, lambda _, a=storage._cdata: _PINNED.pop(a, None))
    return out


fake_tensor._DISPATCH_META_HANDLERS[torch.ops.aten._pin_memory.default] = _pin_memory
fake_tensor._DISPATCH_META_HANDLERS[torch.ops.aten.is_pinned.default] = \
    lambda args: args[0].untyped_storage()._cdata in _PINNED


@correction(torch.ops.fsdp.chunk_cat.default, targets=Target.CPU)
def chunk_cat(args, kwargs, out) -> Fix:
    """The padded (or contiguous) copies ``_pad_chunk`` makes, alive together until the cat ends.
    The gradients it is handed are parameters' (sizes that do not depend on the batch)."""
    bound = bind(torch.ops.fsdp.chunk_cat.default, args, kwargs)
    dim, chunks, out_dtype = bound["dim"], bound["num_chunks"], bound["out"].dtype
    copies, cast = 0, 0
    for t in bound["tensors"]:
        rows = int(t.shape[dim])
        padded = nbytes(t) // rows * (-(-rows // chunks) * chunks) if rows else 0
        if padded != nbytes(t) or not t.is_contiguous():
            copies += padded
        if t.dtype != out_dtype:
            cast = max(cast, padded)
    return Fix(scratch=(copies + cast,)) if copies + cast else Fix()
