"""What makes the environment importable: torchvision beside a CPU build of torch.

``estimator/__init__`` installs a one-shot import hook that calls ``ensure_torchvision_importable``
before ``torchvision`` is first imported (by transformers, timm, peft or the user); the
integrations call it before importing those libraries.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys

import torch

# Kept alive for the whole process: a torch.library.Library unregisters its ops when collected.
_TORCHVISION_STUB: torch.library.Library | None = None

# The torchvision ops whose fake kernels torchvision registers unconditionally at import time
# (torchvision/_meta_registrations.py, 0.28): without their schemas, `import torchvision` fails.
_TORCHVISION_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)


def ensure_torchvision_importable() -> None:
    """Make ``import torchvision`` work when its C++ extension cannot load.

    PyPI's Linux torchvision wheels are CUDA builds: next to the CPU build of torch their
    ``_C.so`` fails to load (it links ``libtorch_cuda.so``). torchvision then skips its custom
    ops, except that ``_meta_registrations`` registers fake kernels for ``torchvision::nms`` and
    ``qnms`` unconditionally and ``import torchvision`` raises ``operator torchvision::nms does
    not exist``; timm and transformers import torchvision, so they fail too. The models do not
    need the extension (it holds detection ops and image decoding), so when it cannot load we
    define the two schemas (no kernel: calling ``torchvision.ops.nms`` still raises
    torchvision's own "Couldn't load custom C++ ops" error) and torchvision imports.
    """
    global _TORCHVISION_STUB
    if "torchvision" in sys.modules or _TORCHVISION_STUB is not None:
        return
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    loader = (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES)
    for folder in spec.submodule_search_locations:
        ext = importlib.machinery.FileFinder(folder, loader).find_spec("_C")
        if ext is None or ext.origin is None:
            continue
        try:
            torch.ops.load_library(ext.origin)  # what torchvision.extension does first
            return
        except (ImportError, OSError):
            break
    if hasattr(torch.ops.torchvision, "nms"):
        return
    _TORCHVISION_STUB = torch.library.Library("torchvision", "DEF")
    for schema in _TORCHVISION_SCHEMAS:
        _TORCHVISION_STUB.define(schema)
