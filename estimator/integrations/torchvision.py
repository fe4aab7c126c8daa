"""torchvision models, built with ``weights=None``, never downloaded.

``name`` is a name of ``torchvision.models.list_models()`` for classification
(``resnet50``, ``vit_b_16``), semantic segmentation (``fcn_resnet50``, ``deeplabv3_resnet50``)
or video classification (``r3d_18``, ``mvit_v1_b``). Detection, keypoint and optical-flow
models take lists of images and targets (no batch dimension to vary) and quantized models
are int8 kernels: they are refused.

``overrides`` are the builder's keyword arguments (``{"num_classes": 10}``,
``{"image_size": 128}`` for ``vit_b_16``). ``weights=None`` always, and ``weights_backbone=None``
unless overridden (segmentation builders default to downloading an ImageNet backbone); any
other download through ``torch.hub`` while building is an InputError.

The sample is one CPU tensor (``model(x)``): ``(batch, 3, H, W)``, or ``(batch, 3, 16, H, W)``
for video (16 frames, the clip length of torchvision's video references, or more when the
weights' ``min_temporal_size`` needs it). H, W is ``image_size`` if given, else the size the
default weights document, read from the weights enum without loading anything: the
``crop_size`` of their transforms (224; 299 for inception_v3, 600 for efficientnet_b7, 112
for r3d_18), the ``resize_size`` for segmentation (520).

``loss_fn``: cross-entropy against class 0 of the logits (classification: ``(b, classes)``;
segmentation: ``out`` ``(b, classes, H, W)``; the aux logits of inception/googlenet are ignored).

Installing next to the CPU build of torch: PyPI's Linux torchvision wheels are CUDA builds
whose C++ extension cannot load against a CPU torch, and torchvision 0.28 then fails at
import (``operator torchvision::nms does not exist``). fxmem defines the two missing op
schemas before importing it (``estimator.compat.ensure_torchvision_importable``); the models are pure
Python and build. ``pip install torch==2.13.0 'torchvision==0.28.*'`` is the pair for torch 2.13.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from estimator.integrations._common import building_on, image_loss, import_optional, pair, randn, suggest
from estimator.vocab.errors import InputError

VIDEO_FRAMES = 16
DEFAULT_SIZE = 224
_REFUSED = ("detection", "optical_flow", "quantization")


def _kind(models, name: str) -> str:
    for kind in ("segmentation", "video", *_REFUSED):
        module = getattr(models, kind, None)
        if module is not None and name in models.list_models(module=module):
            return kind
    return "classification"


def _documented_size(weights, kind: str) -> tuple[int, int]:
    transforms = getattr(weights, "transforms", None)
    keywords = getattr(transforms, "keywords", {}) or {}
    size = keywords.get("crop_size")
    if size is None and kind == "segmentation":
        size = keywords.get("resize_size")
    if isinstance(size, (list, tuple)) and len(size) == 1:
        size = size[0]
    try:
        return pair(size, "size") if size is not None else (DEFAULT_SIZE, DEFAULT_SIZE)
    except InputError:
        return DEFAULT_SIZE, DEFAULT_SIZE


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
    torchvision = import_optional("torchvision", "torchvision")
    models = torchvision.models
    if seq_len is not None:
        raise InputError("seq_len is for text models; torchvision models take images (use image_size)")
    if not isinstance(name, str) or not name:
        raise InputError(f"the torchvision model must be a non-empty string, got {name!r}")
    known = models.list_models()
    if name not in known:
        raise InputError(f"unknown torchvision model {name!r}.{suggest(name, known)} "
                         "(torchvision.models.list_models() lists them all)")
    kind = _kind(models, name)
    if kind in _REFUSED:
        raise InputError(
            f"torchvision {kind} models such as {name!r} are not supported: "
            + ("they are quantized int8 kernels" if kind == "quantization" else
               "they take lists of images (and targets), with no batch dimension to vary")
        )
    try:
        weights = models.get_model_weights(name).DEFAULT  # an enum member: nothing is loaded
    except (ValueError, KeyError, AttributeError):
        weights = None
    kwargs = dict(overrides)
    try:
        parameters = inspect.signature(models.get_model_builder(name)).parameters
    except (ValueError, TypeError):
        parameters = {}
    if "weights_backbone" in parameters:  # segmentation: an ImageNet backbone by default
        kwargs.setdefault("weights_backbone", None)
    if name in ("inception_v3", "googlenet"):  # their default (None) warns, then means True
        kwargs.setdefault("init_weights", True)
    with building_on(device):
        try:
            model = models.get_model(name, weights=None, **kwargs)
        except (TypeError, ValueError) as exc:
            raise InputError(f"torchvision.models.get_model({name!r}, **{overrides}) failed: {exc}") from exc
    if dtype is not None:
        model.to(dtype)
    if image_size is None and isinstance(overrides.get("image_size"), int):
        image_size = overrides["image_size"]
    h, w = pair(image_size, "image_size") if image_size is not None else _documented_size(weights, kind)
    param = next(model.parameters(), None)
    pdtype = param.dtype if param is not None else torch.float32
    if kind == "video":
        meta = getattr(weights, "meta", {}) or {}
        frames = max(VIDEO_FRAMES, int(meta.get("min_temporal_size", 1) or 1))
        sample = randn(batch, 3, frames, h, w, dtype=pdtype)
    else:
        sample = randn(batch, 3, h, w, dtype=pdtype)
    return model, sample, image_loss
