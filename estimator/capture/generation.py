"""What ``mode="generate"`` needs from transformers' ``generate()`` on fake tensors.

With the prompt length ``s`` a symbol, ``generate()`` computes ``min_length = min_new_tokens +
s`` and hands it to logits processors whose constructors check ``isinstance(x, int)``
(transformers/generation/logits_process.py: ``MinLengthLogitsProcessor``,
``MinNewTokensLengthLogitsProcessor``), which a ``torch.SymInt`` fails although it is one.
``symbolic_lengths()`` lets them take it: the check runs on the symbol's hint and the processor
keeps the symbol, so its comparisons stay in ``s``.  Nothing is allocated differently.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch

# (class, the positional names of its int arguments, in order), logits_process.py (transformers 5)
_INT_CHECKED = {
    "MinLengthLogitsProcessor": ("min_length",),
    "MinNewTokensLengthLogitsProcessor": ("prompt_length_to_skip", "min_new_tokens"),
}


def _hint(value):
    return int(value.node.hint) if isinstance(value, torch.SymInt) else value


@contextlib.contextmanager
def symbolic_lengths():
    """Within it, the int-checked logits processors accept ``SymInt`` lengths (see the module)."""
    module = sys.modules.get("transformers.generation.logits_process")
    patched = []
    for name, fields in _INT_CHECKED.items():
        cls = getattr(module, name, None) if module is not None else None
        if cls is None:
            continue
        original = cls.__init__

        @functools.wraps(original)
        def init(self, *args, __original=original, __fields=fields, **kwargs):
            __original(self, *(_hint(a) for a in args), **{k: _hint(v) for k, v in kwargs.items()})
            given = dict(zip(__fields, args)) | {k: v for k, v in kwargs.items() if k in __fields}
            for field, value in given.items():
                setattr(self, field, value)  # the symbol itself

        cls.__init__ = init
        patched.append((cls, original))
    try:
        yield
    finally:
        for cls, original in patched:
            cls.__init__ = original
