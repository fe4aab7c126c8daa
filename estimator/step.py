"""The step fxmem measures: one training step or one inference forward.

The estimator runs it on fake tensors, the validators on real ones: one definition, so the two
can only differ in the tensors they are given.

Train step::

    out = model(sample); loss = loss_fn(out, sample)      # Phase.FORWARD
    loss.backward()                                       # Phase.BACKWARD
    optimizer.step(); optimizer.zero_grad(set_to_none=True)  # Phase.OPTIMIZER

with ``out`` and ``loss`` alive until the step returns.  Inference: ``model.eval()`` and a
``torch.no_grad()`` forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from estimator.categories import Category, Mode, Phase
from estimator.errors import InputError

LossFn = Callable[[Any, Any], torch.Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
PhaseCallback = Callable[[Phase], None]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad,
    "adadelta": torch.optim.Adadelta,
    "adamax": torch.optim.Adamax,
    "nadam": torch.optim.NAdam,
    "radam": torch.optim.RAdam,
    "rmsprop": torch.optim.RMSprop,
    "rprop": torch.optim.Rprop,
}
# Optimizers that need a learning rate to be constructed.
_DEFAULT_KWARGS = {"sgd": {"lr": 1e-3}}


def optimizer_factory(optimizer: str | OptimizerFactory | None) -> OptimizerFactory | None:
    """A callable ``params -> Optimizer`` from a name (``"adamw"``, ``"sgd-momentum"``), a callable or None."""
    if optimizer is None or callable(optimizer):
        return optimizer
    if not isinstance(optimizer, str):
        raise InputError(
            f"optimizer must be None, a name such as 'adamw' or a callable params -> Optimizer, "
            f"got {type(optimizer).__name__}"
        )
    name = optimizer.lower().replace("_", "-")
    kwargs = {}
    if name == "sgd-momentum":
        name, kwargs = "sgd", {"momentum": 0.9}
    if name not in OPTIMIZERS:
        known = ", ".join([*OPTIMIZERS, "sgd-momentum"])
        raise InputError(f"unknown optimizer {optimizer!r}; known names: {known} (or pass a callable)")
    cls, kwargs = OPTIMIZERS[name], {**_DEFAULT_KWARGS.get(name, {}), **kwargs}
    return lambda params: cls(params, **kwargs)


def call_model(model: nn.Module, sample: Any) -> Any:
    """tensor -> ``model(x)``, tuple/list -> ``model(*x)``, dict -> ``model(**x)``."""
    if isinstance(sample, Mapping):
        return model(**sample)
    if isinstance(sample, Sequence) and not isinstance(sample, (str, bytes)):
        return model(*sample)
    return model(sample)


def _find(output: Any, name: str) -> Any:
    if isinstance(output, Mapping):
        return output.get(name)
    return getattr(output, name, None)


def default_loss(output: Any, sample: Any) -> torch.Tensor:
    """``output.loss`` if the model returns one (HF style), else the mean of the first
    floating-point tensor of the output."""
    loss = _find(output, "loss")
    if isinstance(loss, torch.Tensor):
        return loss
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        leaves = [getattr(output, f.name) for f in dataclasses.fields(output)]
    else:
        leaves = tree_flatten(output)[0]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.mean()
    raise InputError(
        f"the model's output ({type(output).__name__}) has no `.loss` and no floating-point tensor "
        "to take the mean of: pass loss_fn=lambda output, sample: ... returning a scalar"
    )


def _check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise InputError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if loss.dim() != 0:
        # A symbolic size prints as its hint (the sample's batch size), not as a symbol.
        shape = tuple(d.node.hint if isinstance(d, torch.SymInt) else d for d in loss.shape)
        raise InputError(
            f"loss_fn must return a scalar tensor, got shape {shape}: reduce it "
            "(e.g. .mean()) before returning"
        )
    if not loss.requires_grad:
        raise InputError(
            "the loss does not require grad: no parameter that requires grad reaches it "
            "(are all parameters frozen, or does loss_fn detach the output?)"
        )
    return loss


def train_step(
    model: nn.Module,
    sample: Any,
    optimizer: torch.optim.Optimizer | None,
    loss_fn: LossFn,
    on_phase: PhaseCallback = lambda phase: None,
) -> tuple[Any, torch.Tensor]:
    """One training step; returns ``(out, loss)`` so that both stay alive to the end."""
    on_phase(Phase.FORWARD)
    out = call_model(model, sample)
    loss = _check_loss(loss_fn(out, sample))
    on_phase(Phase.BACKWARD)
    loss.backward()
    on_phase(Phase.OPTIMIZER)
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    else:
        for p in model.parameters():
            p.grad = None
    return out, loss


def inference_step(model: nn.Module, sample: Any, on_phase: PhaseCallback = lambda phase: None) -> Any:
    """One ``torch.no_grad()`` forward (the model must already be in eval mode)."""
    on_phase(Phase.FORWARD)
    with torch.no_grad():
        return call_model(model, sample)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def prepare(model: nn.Module, mode: Mode, optimizer: OptimizerFactory | None) -> torch.optim.Optimizer | None:
    """Put ``model`` in the mode's train/eval state and build its optimizer (train only)."""
    model.train(mode is Mode.TRAIN)
    if mode is not Mode.TRAIN or optimizer is None:
        return None
    params = trainable(model)
    if not params:
        raise InputError("mode='train' but no parameter requires grad: nothing to train")
    opt = optimizer(params)
    if not isinstance(opt, torch.optim.Optimizer):
        raise InputError(f"the optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
    return opt


def run(model, sample, mode: Mode, optimizer, loss_fn: LossFn, on_phase: PhaseCallback = lambda phase: None):
    """Run the step of ``mode`` (the model already prepared)."""
    if mode is Mode.TRAIN:
        return train_step(model, sample, optimizer, loss_fn, on_phase)
    return inference_step(model, sample, on_phase)


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None, sample: Any):
    """The tensors alive before a step starts, by category, each ``{name: tensor}`` (without
    gradients: the step ends with ``zero_grad(set_to_none=True)``).

    Plain tensor attributes of modules (not registered as buffers) count as buffers.
    """
    params = {name: p for name, p in model.named_parameters()}
    buffers = {name: t for name, t in model.named_buffers()}
    seen = {id(t) for t in [*params.values(), *buffers.values()]}
    for prefix, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and id(value) not in seen:
                seen.add(id(value))
                buffers[f"{prefix}.{attr}" if prefix else attr] = value
    states = {}
    if optimizer is not None:
        param_names = {id(p): name for name, p in model.named_parameters()}
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    states[f"{param_names.get(id(param), 'param')}.{key}"] = value
    inputs, tree = tree_flatten(sample)
    return {
        Category.PARAMETER: params,
        Category.BUFFER: buffers,
        Category.OPTIMIZER_STATE: states,
        Category.INPUT: {f"input{i}": t for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)},
    }
