"""Library code that asks "am I being traced?" takes the branch real eager tensors take.

Some libraries branch on whether they are being traced or compiled, mostly to avoid reading a
tensor's value (a data-dependent branch breaks a graph).  Under fxmem's capture the step runs
eagerly, so every check that asks about the *mode* (``torch.jit.is_tracing``,
``torch.compiler.is_compiling``, ``torch._dynamo.is_compiling``, ``torch.fx._symbolic_trace.
is_fx_tracing``, transformers' ``is_torchdynamo_compiling``) already answers as in a real eager
run (a compiled capture's Dynamo does compile, as the real one).  The checks that ask about the
*tensor* do not: FakeTensors are tensor subclasses and a FakeTensor is, to them, a trace.  Those
are answered here, in one place, as for real tensors wherever the value the branch reads is
known -- it follows the sample alone (``shadows.py``) -- and as before (the tracing branch, the
safe over-estimate) where it is not.

Sites (docs/design.md, "Checks for tracing"):
- torch ``Tensor.__format__`` (``type(self) is Tensor``): a 0-dim tensor in an f-string;
- transformers ``utils.import_utils.is_fake_tensor`` (what ``is_tracing(tensor)`` asks): the
  masks of ``masking_utils`` (``_ignore_causal_mask_sdpa``, ``_ignore_bidirectional_mask_sdpa``:
  a causal (b, 1, s, s) mask built for an all-ones attention mask), ``find_packed_sequence_indices``,
  generation's checks.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensor

from estimator.capture import datadep
from estimator.corrections.data_sizes import active
from estimator.corrections.patches import patched_all


def _known(t) -> bool:
    mode = active()
    return isinstance(t, torch.Tensor) and mode is not None and mode.shadows.get(t) is not None


def _is_fake_tensor(x) -> bool:
    """transformers' ``is_fake_tensor``: True for a fake tensor whose value the capture does not
    know."""
    return isinstance(x, FakeTensor) and not _known(x)


def _format(self, format_spec):
    """``Tensor.__format__`` (torch/_tensor.py) formats a 0-dim tensor as its number only when
    ``type(self) is Tensor``: a fake stand-in of a plain tensor would print as a repr
    (transformers' Switch router: ``self[f"expert_{expert_idx[0]}"]``).  It takes the real
    tensor's branch, its value read as ``.item()`` is (``datadep``).  A compiler's own fake tensors (a
    compiled region's, formatted by its logging: AOTAutograd's structured trace prints torchao's
    float8 tensors with their scales) print as in a real compile: their repr, no value read."""
    if type(self) is FakeTensor and self.dim() == 0 and torch._guards.TracingContext.try_get() is None:
        return self.detach().item().__format__(format_spec)
    return _TENSOR_FORMAT(self, format_spec)


_TENSOR_FORMAT = torch.Tensor.__format__


def _numpy(self, *, force: bool = False):
    """``Tensor.numpy`` (``__array__`` calls it: ``np.asarray(t)``, scipy) raises for tensor
    subclasses.  Host code that reads a fake tensor's values (DETR's matching:
    ``linear_sum_assignment`` of a cost matrix) gets them as a real run would: from the shadow
    where they follow the sample alone, else from the probe's real run (``datadep``), which
    records a real tensor's values by site."""
    if isinstance(self, FakeTensor):
        mode = active()
        values = mode.host(self) if mode is not None else None
        if not isinstance(values, torch.Tensor):
            return values.copy() if values is not None else _TENSOR_NUMPY(self, force=force)
        self = values
    array = _TENSOR_NUMPY(self, force=force)
    probe = datadep.probing()
    if probe is not None:
        probe.host(array)
    return array


_TENSOR_NUMPY = torch.Tensor.numpy


@contextlib.contextmanager
def as_for_real():
    """Answer the tensor checks of torch and of the libraries already imported as for real
    tensors (above)."""
    replacements = [(torch.Tensor, "__format__", _format), (torch.Tensor, "numpy", _numpy)]
    utils = sys.modules.get("transformers.utils.import_utils")
    if utils is not None and hasattr(utils, "is_fake_tensor"):
        replacements.append((utils, "is_fake_tensor", _is_fake_tensor))
    with patched_all(replacements):
        yield
