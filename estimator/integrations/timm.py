"""timm (PyTorch Image Models) models, built with ``pretrained=False``, never downloaded.

``name`` is any name of ``timm.list_models()`` (``resnet50``, ``vit_base_patch16_224``,
``convnext_tiny``), optionally with a pretrained tag (``vit_base_patch16_224.augreg_in21k``),
which only picks the pretrained config (input size, classes); no weights are loaded.
``hf-hub:`` / ``hf_hub:`` names are refused (nothing is downloaded): name the architecture and
give its sizes as ``overrides``.

``overrides`` are ``timm.create_model`` keyword arguments (``{"depth": 2, "embed_dim": 64}``,
``{"num_classes": 10}``, ``{"img_size": 128}``).

The sample is one CPU tensor ``(batch, C, H, W)`` (``model(x)``) of the size in
``model.pretrained_cfg["input_size"]`` (``(3, 224, 224)`` for most models), with H, W from
``image_size`` or the ``img_size`` override if given, C from ``in_chans``.  A ViT-style model
built for one size needs ``overrides={"img_size": ...}`` to take another.

``loss_fn`` is cross-entropy of the logits against class 0 (labels made inside the loss: the
sample is the image tensor alone, as ``model(x)`` takes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from estimator.integrations._common import building_on, image_loss, import_optional, pair, randn, suggest
from estimator.vocab.errors import InputError

_HUB_PREFIXES = ("hf-hub:", "hf_hub:", "local-dir:")


def build(
    name: str,
    batch: int,
    *,
    overrides: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype | None,
    seq_len: int | None,
    image_size: int | tuple[int, int] | None,
):
    timm = import_optional("timm", "timm")
    if seq_len is not None:
        raise InputError("seq_len is for text models; timm models take images (use image_size)")
    if not isinstance(name, str) or not name:
        raise InputError(f"the timm model must be a non-empty string, got {name!r}")
    if name.startswith(_HUB_PREFIXES) or "/" in name:
        raise InputError(
            f"{name!r} names a checkpoint on the Hugging Face Hub or on disk: fxmem never downloads or loads "
            "weights. Name the timm architecture instead (timm:vit_base_patch16_224) and give its sizes "
            "as overrides"
        )
    arch, _ = timm.models.split_model_name_tag(name)
    if not timm.is_model(arch):
        raise InputError(f"unknown timm model {name!r}.{suggest(name, timm.list_models())} (timm.list_models() "
                         "lists them all)")
    with building_on(device):
        try:
            model: nn.Module = timm.create_model(name, pretrained=False, **overrides)
        except (TypeError, ValueError, AssertionError, RuntimeError) as exc:
            raise InputError(f"timm.create_model({name!r}, **{overrides}) failed: {exc}") from exc
    if dtype is not None:
        model.to(dtype)
    cfg = getattr(model, "pretrained_cfg", None) or {}
    channels, height, width = cfg.get("input_size", (3, 224, 224))
    channels = overrides.get("in_chans", channels)
    if image_size is None and "img_size" in overrides:
        image_size = overrides["img_size"]
    if image_size is not None:
        height, width = pair(image_size, "image_size")
    param = next(model.parameters(), None)
    sample = randn(batch, channels, height, width, dtype=param.dtype if param is not None else torch.float32)
    return model, sample, image_loss
