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
import itertools
import sys

import torch

from estimator.corrections.patches import patched, patched_all

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


@contextlib.contextmanager
def stopped_after(model: torch.nn.Module, calls: int | None):
    """Within it, ``model.generate()``'s loop is left after ``calls`` calls of the model (None: as
    it runs).  The loop asks ``_has_unfinished_sequences`` (host Python, no tensor op) before each
    iteration; the first consumes the prefill's output, each later one calls the model once
    (transformers/generation/utils.py ``_sample``): it is left as a real run of ``calls`` tokens
    leaves it, every size still the one the call's arguments give (``max_new_tokens``)."""
    if calls is None:
        yield
        return
    asked = itertools.count(1)
    original = model._has_unfinished_sequences

    def unfinished(*args, **kwargs) -> bool:
        return next(asked) <= calls and original(*args, **kwargs)

    with patched(model, "_has_unfinished_sequences", unfinished):
        yield


# Cache layers (transformers/cache_utils.py) whose tensors grow the same way at every decode step
# once steady: by one token (DynamicLayer), not at all (StaticLayer), or by one token dropped and
# one added once the window is full (the sliding ones, by the attribute that bounds them)
_STEADY_LAYERS = {"DynamicLayer": None, "StaticLayer": None,
                  "DynamicSlidingWindowLayer": "sliding_window", "StaticSlidingWindowLayer": "max_cache_len"}
_LENGTHS = {"DynamicSlidingWindowLayer": "cumulative_length", "StaticSlidingWindowLayer": "cumulative_length_int"}


def cache_steady(cache) -> bool | None:
    """Whether every layer of a transformers cache now grows as it will at every later decode step
    (a sliding window already full); False while a window still fills; None for a cache whose
    growth fxmem does not know (quantized or offloaded layers, a cache of another kind, a window
    whose fill depends on a symbolic prompt length)."""
    caches = [getattr(cache, name, None) for name in ("self_attention_cache", "cross_attention_cache")]
    caches = [c for c in caches if c is not None] or [cache]  # an encoder-decoder cache: both of its caches
    steady = True
    for c in caches:
        layers = getattr(c, "layers", None)
        if not isinstance(layers, list) or getattr(c, "offloading", False):
            return None
        for layer in layers:
            kind = type(layer).__name__
            if kind not in _STEADY_LAYERS:
                return None
            if _STEADY_LAYERS[kind] is None or getattr(layer, "is_initialized", True) is False:
                continue  # (a layer no call updated: a block the shallow copy of repeated blocks leaves out)
            length, window = getattr(layer, _LENGTHS[kind], None), getattr(layer, _STEADY_LAYERS[kind], None)
            if not isinstance(length, int) or not isinstance(window, int):
                return None
            steady = steady and length >= window
    return steady


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
