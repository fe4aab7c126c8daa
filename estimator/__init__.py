"""fxmem: static memory estimates of PyTorch training and inference steps, as formulas in the batch size.

>>> import torch, estimator
>>> rep = estimator.report(torch.nn.Linear(16, 4), torch.randn(8, 16), optimizer="sgd")  # the default GPU (H100)
>>> rep.device, rep.target.gpu.name, rep.peak_bytes <= rep.reserved_bytes <= rep.device_bytes
('cuda', 'NVIDIA H100 80GB HBM3', True)
>>> estimator.report(torch.nn.Linear(16, 4), torch.randn(8, 16), optimizer="sgd", device="cpu").device
'cpu'

Importing ``estimator`` does not import torch: the names that need it load on first use
(PEP 562), so ``fxmem --help`` and ``import estimator.vocab.errors`` stay fast.
"""

import importlib
import importlib.abc
import sys

from estimator.vocab.categories import Category, Mode, Phase, Target
from estimator.vocab.errors import CaptureError, FxmemError, InputError
from estimator.vocab.units import GiB, KiB, MiB, format_bytes, parse_bytes

_LAZY = {
    "report": "estimator.api",
    "Request": "estimator.vocab.request",
    "estimate": "estimator.orchestrate.estimate",
    "MemoryMonitor": "estimator.monitor",
    "MemoryWarning": "estimator.monitor",
    "CapturePath": "estimator.reporting.result",
    "ModuleRow": "estimator.reporting.result",
    "Piece": "estimator.reporting.result",
    "Report": "estimator.reporting.result",
    "B": "estimator.vocab.symbolic",
    "S": "estimator.vocab.symbolic",
    "Strategy": "estimator.vocab.strategy",
    "Sharding": "estimator.vocab.strategy",
    "Schedule": "estimator.vocab.strategy",
    "RankReport": "estimator.reporting.result",
    "compare": "estimator.planning",
    "plan": "estimator.planning",
    "forget_captures": "estimator.orchestrate.reuse",
    "own_plans": "estimator.capture.model_plans",
    "progress": "estimator.progress_bars",
    "Comparison": "estimator.planning",
    "Poly": "estimator.vocab.symbolic",
    "CudaMemory": "estimator.devices.cuda",
    "Overhead": "estimator.devices.cuda",
    "register_op": "estimator.corrections.custom_ops",
    "unregister_op": "estimator.corrections.custom_ops",
}

__all__ = [
    "B",
    "CaptureError",
    "CapturePath",
    "Category",
    "Comparison",
    "CudaMemory",
    "FxmemError",
    "GiB",
    "InputError",
    "KiB",
    "MemoryMonitor",
    "MemoryWarning",
    "MiB",
    "Mode",
    "ModuleRow",
    "Overhead",
    "Phase",
    "Piece",
    "Poly",
    "RankReport",
    "Report",
    "Request",
    "S",
    "Schedule",
    "Sharding",
    "Strategy",
    "Target",
    "compare",
    "estimate",
    "forget_captures",
    "format_bytes",
    "own_plans",
    "parse_bytes",
    "plan",
    "progress",
    "register_op",
    "report",
    "unregister_op",
]
__version__ = "0.1.0"


class _TorchvisionFirst(importlib.abc.MetaPathFinder):
    """Before ``torchvision`` is first imported (by transformers, timm, peft or the user), make
    it importable where its C++ extension cannot load (PyPI's Linux torchvision is a CUDA build:
    beside the CPU torch ``import torchvision`` raises "operator torchvision::nms does not
    exist"): ``compat.ensure_torchvision_importable``.  Once, then out of the way."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            from estimator.compat import ensure_torchvision_importable

            ensure_torchvision_importable()
        return None


if "torchvision" not in sys.modules and not any(isinstance(f, _TorchvisionFirst) for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchvisionFirst())


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'estimator' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_LAZY})
