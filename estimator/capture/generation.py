"""What ``mode="generate"`` needs from transformers' ``generate()`` on fake tensors: symbolic
prompt lengths its logits processors accept, and a stand-in that answers its data-dependent
values for a model on the meta device.

With the prompt length ``s`` a symbol, ``generate()`` computes ``min_length = min_new_tokens +
s`` and hands it to logits processors whose constructors check ``isinstance(x, int)``
(transformers/generation/logits_process.py: ``MinLengthLogitsProcessor``,
``MinNewTokensLengthLogitsProcessor``), which a ``torch.SymInt`` fails although it is one.
``symbolic_lengths()`` lets them take it: the check runs on the symbol's hint and the processor
keeps the symbol, so its comparisons stay in ``s``.  Nothing is allocated differently.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys

import torch

from estimator.corrections.patches import patched_all

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
    replacements = []
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

        replacements.append((cls, "__init__", init))
    with patched_all(replacements):
        yield


# The width-like fields of transformers configs a narrow stand-in shrinks (the other fields,
# layers and their types, positions, vocabulary and token ids, stay the model's).
_NARROW = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 32, "num_attention_heads": 4, "head_dim": 16}


def narrow_stand_in(model: torch.nn.Module) -> torch.nn.Module | None:
    """A stand-in for a transformers model whose weights are on the meta device, to answer the
    values ``generate()`` asks (``.item()`` of the padding checks and of the stopping test: they
    depend on the attention mask and, with ``min_new_tokens = max_new_tokens``, on the token
    count, not on the weights): the model's class and config, every layer kept, the widths
    shrunk (``_NARROW``; grouped-query attention kept grouped), random CPU weights.  None when
    it cannot be built (a config whose widths are named otherwise).  The caller refuses it where
    a value does depend on the weights (an MoE's routing)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    config = copy.deepcopy(config)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    for field, value in _NARROW.items():
        if getattr(text, field, None) is not None:
            setattr(text, field, value)
    if kv_heads is not None and heads:
        text.num_key_value_heads = 4 if kv_heads == heads else 2 if kv_heads > 1 else 1
    try:
        with torch.device("cpu"):
            return type(model)(config).eval()
    except Exception:  # noqa: BLE001 -- any failure: the stand-in is not available, the caller says why
        return None
