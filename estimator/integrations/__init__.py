"""Models from transformers, timm and torchvision, built from code for ``estimator.report``.

    import estimator
    from estimator import integrations

    model, sample, loss_fn = integrations.build("transformers", "llama", batch=8)
    rep = estimator.report(model, sample, batch=8, loss_fn=loss_fn)

``build(source, name, batch=2) -> (model, sample, loss_fn)``:

- ``source``: ``"transformers"``, ``"timm"`` or ``"torchvision"``;
- ``name``: what that library calls the model (see each module's docstring:
  ``estimator.integrations.transformers`` also takes a local folder holding ``config.json``, or a
  Hub id ``org/name[@revision]``, of which only ``config.json`` is fetched or read from the local
  Hugging Face cache);
- the model has random weights on the **meta device** (no memory, no weights downloaded: a timm
  or torchvision hub id is an InputError saying how to pass a local config); ``device="cpu"`` builds the same
  model with real (seeded) weights, for measuring it;
- ``sample``: CPU tensors whose dim 0 is ``batch``: token ids ``(batch, seq)`` (plus labels, so
  that ``output.loss`` exists) for language models, pixels at the model's documented resolution
  for vision models;
- ``loss_fn``: ``(output, sample) -> scalar``, or None for fxmem's default (``output.loss``).

Keyword-only options: ``overrides`` (config fields for transformers, builder keyword arguments
for timm and torchvision: ``{"n_layer": 2, "n_embd": 64}``), ``device``, ``dtype`` (default:
float32, or a transformers config's own dtype), ``seq_len`` (text), ``image_size`` (vision).

Installing (``pip install 'fxmem[transformers]'``, ``'fxmem[timm]'``, ``'fxmem[torchvision]'``):
all three import torchvision (timm requires it; transformers imports it when present), whose
version must match torch's: torch 2.13 -> torchvision 0.28 (``pip install torch==2.13.0
'torchvision==0.28.*' timm transformers``; without the pin pip may pick a newer torchvision
and replace torch). PyPI's Linux torchvision is a CUDA build: next to the CPU build of torch
its C++ extension cannot load and torchvision 0.28 fails at import; fxmem works around that
(``estimator.compat.ensure_torchvision_importable``: the models are pure Python). Checked with torch
2.13.0+cpu, torchvision 0.28.0, timm 1.0.31, transformers 5.24.0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from estimator.integrations import _common
from estimator.vocab.errors import InputError

SOURCES = ("transformers", "timm", "torchvision")

__all__ = ["SOURCES", "build"]


def _builder(source: str) -> Callable[..., tuple[nn.Module, Any, Any]]:
    if source == "transformers":
        from estimator.integrations import transformers as module
    elif source == "timm":
        from estimator.integrations import timm as module
    elif source == "torchvision":
        from estimator.integrations import torchvision as module
    else:
        raise InputError(f"unknown model source {source!r}.{_common.suggest(str(source), SOURCES, n=1)} "
                         f"Sources: {', '.join(SOURCES)}")
    return module.build


def build(
    source: str,
    name: str,
    batch: int = 2,
    *,
    overrides: dict[str, Any] | None = None,
    device: str | torch.device = "meta",
    dtype: str | torch.dtype | None = None,
    seq_len: int | None = None,
    image_size: int | tuple[int, int] | None = None,
    quantization: Any = None,
) -> tuple[nn.Module, Any, Callable[[Any, Any], torch.Tensor] | None]:
    """Build ``name`` from ``source`` with random weights; returns ``(model, sample, loss_fn)``.

    Args:
        source: ``"transformers"``, ``"timm"`` or ``"torchvision"``.
        name: the model's name in that library (``"gpt2"``, ``"resnet50"``, a local config folder…).
        batch: dim 0 of every sample tensor.
        overrides: config fields / builder keyword arguments, e.g. a small size for tests.
        device: ``"meta"`` (default: no memory) or a real device (seeded random weights).
        dtype: the parameters' dtype (default float32, or a transformers config's ``dtype``).
        seq_len: tokens per sample for text models (default ``min(max positions, 512)``).
        image_size: H (= W) or (H, W) of the sample for vision models (default: the model's).
        quantization: transformers only: a ``BitsAndBytesConfig`` (or its dict), loaded as
            ``from_pretrained(quantization_config=...)`` would (``estimator.integrations.bitsandbytes``:
            4-bit / 8-bit weights sized without the weights); None: the config's own
            ``quantization_config`` (a pre-quantized Hub model); False: none.

    Raises:
        InputError: unknown source or name (with close matches), a Hub id whose config cannot be
            had (offline and not cached, gated, unknown), a timm/torchvision hub id, a missing package
            (naming ``pip install 'fxmem[...]'``), an override the model does not take.
    """
    builder = _builder(source)
    if quantization is not None and source != "transformers":
        raise InputError(f"quantization= applies to transformers models only, not to {source!r}")
    extra = {"quantization": quantization} if source == "transformers" else {}
    return builder(
        name,
        _common.check_batch(batch),
        overrides=_common.check_overrides(overrides),
        device=_common.check_device(device),
        dtype=None if dtype is None else _common.check_dtype(dtype),
        seq_len=seq_len,
        image_size=image_size,
        **extra,
    )
