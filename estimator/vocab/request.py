"""What the user asks for: ``Request``, the arguments of ``estimator.report`` as one value.

``report(model, sample, **options)`` is ``estimate(Request(model, sample, **options))``;
``compare`` and ``plan`` build the same object from the same options (once per strategy), and the
command line and the integrations call those faces with them, so an option means one thing
everywhere.  Nothing here is checked: ``estimator.orchestrate.checked`` turns a
Request into the step the captures run, with an ``InputError`` that names each bad argument.
``report``'s docstring documents every field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

DEVICES = ("cpu", "cuda")
DEFAULT_OPTIMIZER = "adamw"


@dataclasses.dataclass(frozen=True, eq=False)  # holds a model and tensors: compared by identity
class Request:
    model: Any  # an nn.Module
    sample: Any  # a tensor, a tuple/list or a dict of them
    batch: int | None = None
    mode: str = "train"
    optimizer: Any = DEFAULT_OPTIMIZER  # a name, an optimizer factory or None
    loss_fn: Any = None
    device: str = "cuda"
    gpu: str | int | None = None
    alloc_conf: str | None = None
    amp: str | None = None
    grad_scaler: bool | None = None
    dynamic: Mapping | None = None
    strategy: Any = None  # an estimator.Strategy
    data_dependent: Any = "max"
    batch_dims: int | Mapping | None = None
    step: Any = None  # the user's step(model, sample, state)
    keep_output: bool | None = None
    new_tokens: int | None = None
    cache_implementation: str | None = None
    dtype_symbols: bool = False
    compile: Any = None
    depth_symbols: bool = False

    def replace(self, **changes) -> Request:
        """A copy with ``changes`` (the fields' names: ``strategy=``, ``batch=`` …)."""
        return dataclasses.replace(self, **changes)
