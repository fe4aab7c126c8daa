"""fxmem: static memory estimates of PyTorch training and inference steps, as formulas in the batch size.

>>> import torch, estimator
>>> rep = estimator.report(torch.nn.Linear(16, 4), torch.randn(8, 16), optimizer="sgd")
>>> rep.peak_bytes > 0
True
"""

from estimator.categories import Category, Mode, Phase
from estimator.errors import CaptureError, FxmemError, InputError
from estimator.estimate import report
from estimator.report.result import CapturePath, ModuleRow, Piece, Report
from estimator.symbolic import B, Poly
from estimator.units import GiB, KiB, MiB, format_bytes, parse_bytes

__all__ = [
    "B", "Category", "CaptureError", "CapturePath", "FxmemError", "GiB", "InputError", "KiB", "MiB",
    "Mode", "ModuleRow", "Phase", "Piece", "Poly", "Report", "format_bytes", "parse_bytes", "report",
]
__version__ = "0.1.0"
