"""Helpers shared by the integrations: optional imports, suggestions, samples, the vision loss."""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.machinery
import importlib.util
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from estimator.compat import ensure_torchvision_importable
from estimator.corrections.patches import patched
from estimator.vocab.errors import InputError

SEED = 0  # samples (and real-device weights) are the same on every call

def import_optional(module: str, extra: str) -> Any:
    """``import module`` or an InputError naming the pip extra that installs it."""
    if module in ("timm", "transformers", "torchvision"):
        ensure_torchvision_importable()  # timm and transformers import torchvision
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise InputError(
            f"the {extra} integration needs the {module!r} package, which is not installed ({exc}): "
            f"pip install 'fxmem[{extra}]'"
        ) from exc
    except RuntimeError as exc:  # a torchvision whose binary does not match torch
        raise InputError(
            f"importing {module!r} failed: {exc}. torchvision must match the installed torch "
            f"{torch.__version__} (torch 2.13 -> torchvision 0.28): reinstall it, e.g. "
            f"pip install 'torchvision==0.28.*' for torch 2.13"
        ) from exc


def suggest(name: str, candidates: Iterable[str], n: int = 3) -> str:
    """`` Did you mean 'a', 'b'?`` for the close matches of ``name`` (case-insensitive), or ''."""
    by_lower: dict[str, str] = {}
    for c in candidates:
        by_lower.setdefault(c.lower(), c)
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=n, cutoff=0.6)
    if not close:
        return ""
    return " Did you mean " + ", ".join(repr(by_lower[c]) for c in close) + "?"


def check_batch(batch: Any) -> int:
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InputError(f"batch must be a positive int, got {batch!r}")
    return batch


def check_overrides(overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    if overrides is None:
        return {}
    if not isinstance(overrides, Mapping) or not all(isinstance(k, str) for k in overrides):
        raise InputError(f"overrides must be a dict of str -> value, got {overrides!r}")
    return dict(overrides)


def check_dtype(dtype: Any) -> torch.dtype:
    if dtype is None:
        return torch.get_default_dtype()
    if isinstance(dtype, str):
        value = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(value, torch.dtype):
            return value
    if isinstance(dtype, torch.dtype):
        return dtype
    raise InputError(f"dtype must be a torch.dtype or a name such as 'bfloat16', got {dtype!r}")


def check_device(device: Any) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InputError(f"device must be a torch device such as 'meta' or 'cpu', got {device!r}") from exc


def _no_download(url: str, *args: Any, **kwargs: Any) -> None:
    raise InputError(
        f"building this model would download {url}: fxmem builds models with random weights only. "
        "Pass the builder's weights argument as None in overrides (e.g. {'weights_backbone': None})"
    )


@contextlib.contextmanager
def building_on(device: torch.device):
    """Build modules on ``device``; on a real device with seeded weights (the same model every
    call). Any download through ``torch.hub`` (pretrained backbones) is an InputError."""
    import torch.hub

    with patched(torch.hub, "download_url_to_file", _no_download), torch.device(device):
        if device.type == "meta":
            yield
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(SEED)
                yield


def generator() -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(SEED)


def randint(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, max(int(high), 1), shape, generator=generator(), dtype=torch.int64)


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=generator(), dtype=torch.float32).to(dtype)


def pair(size: Any, what: str) -> tuple[int, int]:
    """``224`` or ``(224, 224)`` -> ``(224, 224)``."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size, size
    if isinstance(size, Sequence) and len(size) == 2 and all(isinstance(s, int) for s in size):
        return int(size[0]), int(size[1])
    raise InputError(f"{what} must be an int or a (height, width) pair, got {size!r}")


def _logits(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):  # torchvision segmentation: {"out": ..., "aux": ...}
        output = output.get("out", next(iter(output.values()), None))
        return _logits(output)
    if isinstance(output, Sequence) and output:  # (logits, aux_logits) of inception/googlenet
        return _logits(output[0])
    return None


def image_loss(output: Any, sample: Any) -> torch.Tensor:
    """Cross-entropy against class 0: on ``(b, classes)`` logits (classification, video) or
    ``(b, classes, h, w)`` maps (segmentation); the mean of the output otherwise.

    A tensor sample holds no labels (timm and torchvision models take ``model(x)``), so the
    targets are made here, during the step (``8·b`` or ``8·b·h·w`` bytes, as a real training
    loop holds its labels)."""
    logits = _logits(output)
    if logits is None or not logits.is_floating_point():
        raise InputError(
            f"cannot make a loss from the model's output ({type(output).__name__}): "
            "pass loss_fn=lambda output, sample: ... returning a scalar"
        )
    if logits.dim() == 2:
        return F.cross_entropy(logits, logits.new_zeros(logits.shape[0], dtype=torch.int64))
    if logits.dim() == 4:
        b, _, h, w = logits.shape
        return F.cross_entropy(logits, logits.new_zeros((b, h, w), dtype=torch.int64))
    return logits.mean()
