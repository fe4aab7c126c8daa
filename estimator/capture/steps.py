"""The step fxmem measures: one training step or one inference forward.

The estimator runs it on fake tensors, the validators on real ones: one definition, so the two
can only differ in the tensors they are given.

Train step::

    out = model(sample); loss = loss_fn(out, sample)      # Phase.FORWARD
    loss.backward()                                       # Phase.BACKWARD
    optimizer.step(); optimizer.zero_grad(set_to_none=True)  # Phase.OPTIMIZER

with ``out`` and ``loss`` alive until the step returns (``keep_output=False``: ``out`` is
dropped before ``backward()``, as Hugging Face's ``Trainer``, Lightning and torchtitan do).
Inference: ``model.eval()`` and a ``torch.no_grad()`` forward.

A user's own step (``report(step=fn)``) replaces all of this: ``fn(model, sample, state)``
runs as written, ``state`` being what the optimizer factory built from the model
(``user_state``): an optimizer, or a tuple/dict of them with other training state (an EMA copy,
a ``GradScaler``).

Mixed precision (``Precision``) is the standard recipe::

    with torch.autocast(device_type, dtype):               # Phase.FORWARD
        out = model(sample); loss = loss_fn(out, sample)
    scaler.scale(loss).backward()                          # Phase.BACKWARD
    scaler.step(optimizer); scaler.update()                # Phase.OPTIMIZER
    optimizer.zero_grad(set_to_none=True)

(without a scaler: ``loss.backward()`` and ``optimizer.step()``); inference runs its
``no_grad`` forward inside the same ``torch.autocast`` region.

A ``Strategy`` (``estimator.vocab.strategy``) changes the train step: ``accumulate=k`` runs the
forward and backward on ``k`` micro-batches (views ``chunk(k)`` of the sample along its batch
dim, dim 0 unless ``batch_dims`` says otherwise, the full sample staying alive), each loss divided by ``k``, the gradients accumulating from the
second backward on, then one optimizer step; ``out`` and ``loss`` of a micro-step stay alive
until the next micro-step's forward has produced its own (plain Python rebinding), the last
ones to the end.  ``checkpoint`` runs the selected modules under
``torch.utils.checkpoint.checkpoint`` for the whole step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_unflatten

from estimator.capture import generation, world
from estimator.capture.checkpointing import checkpointing
from estimator.capture.tracker import wrapped
from estimator.corrections.patches import patched
from estimator.vocab.categories import Category, Mode, Phase
from estimator.vocab.errors import InputError
from estimator.vocab.strategy import DEFAULT, Strategy

LossFn = Callable[[Any, Any], torch.Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
StepFn = Callable[[nn.Module, Any, Any], Any]  # the user's step: fn(model, sample, state)
StateFactory = Callable[[nn.Module], Any]  # with step=: model -> the state the step is handed
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
_DEFAULT_KWARGS = {"sgd": {"lr": 1e-3}}  # optimizers that need a learning rate to be constructed
# Optimizers of optional libraries, by name (``-`` / ``_`` ignored, any case; transformers'
# ``TrainingArguments(optim=)`` names too): (module, class).  bitsandbytes keeps 8-bit states in blocks
# of 256 (fp32 under ``min_8bit_size``, 4,096 elements), ``paged`` ones those of >= 100,000 elements in
# CUDA managed memory; torchao's compile their update; its CPUOffloadOptimizer steps AdamW on the CPU.
LOW_BIT_OPTIMIZERS: dict[str, tuple[str, str]] = {
    "adam8bit": ("bitsandbytes.optim", "Adam8bit"),
    "adamw8bit": ("bitsandbytes.optim", "AdamW8bit"),
    "adamwbnb8bit": ("bitsandbytes.optim", "AdamW8bit"),
    "pagedadamw": ("bitsandbytes.optim", "PagedAdamW"),
    "pagedadamw32bit": ("bitsandbytes.optim", "PagedAdamW"),
    "pagedadamw8bit": ("bitsandbytes.optim", "PagedAdamW8bit"),
    "lion8bit": ("bitsandbytes.optim", "Lion8bit"),
    "pagedlion8bit": ("bitsandbytes.optim", "PagedLion8bit"),
    "adamwtorch8bit": ("torchao.optim", "AdamW8bit"),
    "aoadamw8bit": ("torchao.optim", "AdamW8bit"),
    "adamwtorch4bit": ("torchao.optim", "AdamW4bit"),
    "aoadamw4bit": ("torchao.optim", "AdamW4bit"),
    "aoadamwfp8": ("torchao.optim", "AdamWFp8"),
    "cpuoffloadadamw": ("torchao.optim", "CPUOffloadOptimizer"),  # a GPU only: its constructor asserts one
}


def optimizer_factory(optimizer: str | OptimizerFactory | None) -> OptimizerFactory | None:
    """A callable ``params -> Optimizer`` from a name (``"adamw"``, ``"sgd-momentum"``,
    ``"adamw8bit"``), a callable or None."""
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
    if name.replace("-", "") in LOW_BIT_OPTIMIZERS:
        cls = _low_bit(optimizer, *LOW_BIT_OPTIMIZERS[name.replace("-", "")])
    elif name in OPTIMIZERS:
        cls, kwargs = OPTIMIZERS[name], {**_DEFAULT_KWARGS.get(name, {}), **kwargs}
    else:
        known = ", ".join([*OPTIMIZERS, "sgd-momentum", *LOW_BIT_OPTIMIZERS])
        raise InputError(f"unknown optimizer {optimizer!r}; known names: {known} (or pass a callable)")
    return lambda params: cls(params, **kwargs)


def _low_bit(name: str, module: str, cls: str) -> type[torch.optim.Optimizer]:
    """The class of a low-bit optimizer name, or an ``InputError`` naming the package to install."""
    import importlib

    package = module.split(".")[0]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        raise InputError(f"optimizer {name!r} is {package}'s {cls}, and {package} does not import here ({exc}): "
                         f"pip install {package}") from None


AMP_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Precision:
    """The step's precision: ``amp`` is the ``torch.autocast`` dtype (``"fp16"``, ``"bf16"``, or
    None: no autocast), ``grad_scaler`` whether a ``GradScaler`` scales the loss (train)."""

    amp: str | None = None
    grad_scaler: bool = False

    def __post_init__(self) -> None:
        if self.amp is not None and self.amp not in AMP_DTYPES:
            raise InputError(f"amp must be one of {tuple(AMP_DTYPES)} or None, got {self.amp!r}")
        if self.grad_scaler and self.amp is None:
            raise InputError("grad_scaler=True needs mixed precision: pass amp='fp16' (or 'bf16') with it")

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype (None without autocast)."""
        return None if self.amp is None else AMP_DTYPES[self.amp]

    @classmethod
    def of(cls, amp: str | None, grad_scaler: bool | None, mode: Mode) -> Precision:
        """The precision of ``report(amp=, grad_scaler=)``, checked: ``grad_scaler`` defaults to
        True for ``amp="fp16"`` in training (fp16 gradients underflow without loss scaling),
        else False (bf16 has fp32's range); a scaler needs ``amp`` and ``mode="train"``."""
        if amp is not None and not isinstance(amp, str):
            raise InputError(f"amp must be one of {tuple(AMP_DTYPES)} or None, got {amp!r}")
        name = None if amp is None else amp.lower()
        if name is not None and name not in AMP_DTYPES:
            raise InputError(f"amp must be one of {tuple(AMP_DTYPES)} or None, got {amp!r}")
        if grad_scaler is not None and not isinstance(grad_scaler, bool):
            raise InputError(f"grad_scaler must be True, False or None (the default), got {grad_scaler!r}")
        if grad_scaler and name is None:
            raise InputError("grad_scaler=True needs mixed precision: pass amp='fp16' (or 'bf16') with it")
        if grad_scaler and mode is not Mode.TRAIN:
            raise InputError("grad_scaler=True scales the loss of a training step: it needs mode='train'")
        if grad_scaler is None:
            grad_scaler = name == "fp16" and mode is Mode.TRAIN
        return cls(name, grad_scaler)


FP32 = Precision()


def _finite_gradients(original):
    """``GradScaler._maybe_opt_step`` that takes the "gradients are finite" branch when the inf/nan
    flags are fake tensors (``original`` otherwise).

    ``_maybe_opt_step`` reads the flags with ``.item()`` to decide whether to call
    ``optimizer.step()``: data-dependent, which a ``FakeTensor`` cannot answer (it raises).  The
    fake run assumes finite gradients (what every step but the skipped ones does; a skipped step
    allocates less)."""

    def maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        if any(isinstance(v, FakeTensor) for v in optimizer_state["found_inf_per_device"].values()):
            return optimizer.step(*args, **kwargs)
        return original(self, optimizer, optimizer_state, *args, **kwargs)

    return maybe_opt_step


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose ``step`` assumes finite gradients on fake tensors
    (``_finite_gradients``); on real tensors ``torch.amp.GradScaler`` unchanged."""

    _maybe_opt_step = _finite_gradients(torch.amp.GradScaler._maybe_opt_step)


@contextlib.contextmanager
def finite_gradients():
    """Every ``torch.amp.GradScaler`` (a user's own, in ``report(step=)``) assumes finite
    gradients on fake tensors, for the block."""
    with patched(torch.amp.GradScaler, "_maybe_opt_step", _finite_gradients(torch.amp.GradScaler._maybe_opt_step)):
        yield


def device_type(model: nn.Module, sample: Any = ()) -> str:
    """The device type the step runs on (``torch.autocast``'s and ``GradScaler``'s argument): the
    first parameter's or buffer's, else the first sample tensor's, else ``"cpu"``.  Fake tensors
    are CPU tensors, so the fake run autocasts as ``"cpu"`` whatever the target."""
    for t in [*model.parameters(), *model.buffers(), *tree_flatten(sample)[0]]:
        if isinstance(t, torch.Tensor):
            return t.device.type
    return "cpu"


def autocast(precision: Precision, device: str):
    """``torch.autocast(device, precision.dtype)``, or a no-op without ``amp``."""
    if precision.amp is None:
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=precision.dtype)


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
    precision: Precision = FP32,
    scaler: torch.amp.GradScaler | None = None,
    strategy: Strategy = DEFAULT,
    batch_dims: tuple[int, ...] | None = None,
    keep_output: bool = True,
) -> tuple[Any, torch.Tensor]:
    """One training step; returns ``(out, loss)`` (of the last micro-step) so that both stay
    alive to the end (``keep_output=False``: ``out`` is dropped before backward, None returned).

    With ``scaler`` the loss is scaled before backward and ``scaler.step`` unscales the
    gradients (skipping ``optimizer.step()`` on inf/nan) and ``scaler.update()`` adjusts the
    scale; without an optimizer the scaled loss is back-propagated and nothing is stepped.
    ``strategy``: gradient accumulation and activation checkpointing (module docstring);
    ``batch_dims``: the dim micro-batches split, per leaf of ``tree_flatten(sample)`` (default 0)."""
    k = strategy.accumulate
    device = device_type(model, sample)
    with checkpointing(model, strategy):
        for micro in micro_batches(sample, k, batch_dims):
            on_phase(Phase.FORWARD)
            with autocast(precision, device):
                out = call_model(model, micro)
                loss = _check_loss(loss_fn(out, micro))
                if k > 1:
                    loss = loss / k
            if not keep_output:
                out = None
            on_phase(Phase.BACKWARD)
            (loss if scaler is None else scaler.scale(loss)).backward()
    on_phase(Phase.OPTIMIZER)
    if optimizer is not None:
        optimizer_step(optimizer, scaler)
    else:
        for p in model.parameters():
            p.grad = None
    return out, loss


def micro_batches(sample: Any, k: int, batch_dims: tuple[int, ...] | None = None) -> list[Any]:
    """``sample`` split along the batch dim (``batch_dims``: per leaf of ``tree_flatten``, default
    0) into ``k`` equal micro-batches (``narrow`` views, like ``split(b // k)``; ``[sample]`` for
    k = 1)."""
    if k == 1:
        return [sample]
    leaves, spec = tree_flatten(sample)
    parts = []
    for t, d in zip(leaves, batch_dims or (0,) * len(leaves)):
        if isinstance(t, torch.Tensor):
            size = t.shape[d] // k  # b = k * micro-batch (checked by report; a symbol's k*m // k is m)
            parts.append([t.narrow(d, i * size, size) for i in range(k)])  # no guard on a symbolic size
        else:
            parts.append([t] * k)
    return [tree_unflatten([p[i] for p in parts], spec) for i in range(k)]


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None = None) -> None:
    """``optimizer.step()`` (through ``scaler.step``/``update`` with a scaler), then
    ``zero_grad(set_to_none=True)``."""
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)


def inference_step(
    model: nn.Module, sample: Any, on_phase: PhaseCallback = lambda phase: None, precision: Precision = FP32
) -> Any:
    """One ``torch.no_grad()`` forward (the model must already be in eval mode), autocast with
    ``precision.amp``."""
    on_phase(Phase.FORWARD)
    with torch.no_grad(), autocast(precision, device_type(model, sample)):
        return call_model(model, sample)


CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")


@dataclasses.dataclass(frozen=True)
class Generation:
    """``mode="generate"``'s step: ``model.generate(**sample, max_new_tokens=n,
    min_new_tokens=n, do_sample=False)`` (``cache_implementation="static"``: a ``StaticCache``
    allocated for the whole sequence at the prefill; None or ``"dynamic"``: transformers'
    default ``DynamicCache``, grown by ``torch.cat`` at every step).  ``min_new_tokens`` keeps an
    end-of-sequence token from stopping it early: the run is prefill plus ``n - 1`` decode
    steps whatever the weights.  Called as a user's step: ``(model, sample, state)``."""

    new_tokens: int
    cache_implementation: str | None = None
    # the capture's shortened run (``capture.decode_steps``): generate() as for ``new_tokens``, its
    # loop left after this many calls of the model (None: every call)
    stop_after: int | None = None

    def kwargs(self) -> dict[str, Any]:
        kwargs = {"max_new_tokens": self.new_tokens, "min_new_tokens": self.new_tokens, "do_sample": False}
        if self.cache_implementation not in (None, "dynamic"):
            kwargs["cache_implementation"] = self.cache_implementation
        return kwargs

    def __call__(self, model: nn.Module, sample: Any, state: Any = None) -> Any:
        with generation.stopped_after(model, self.stop_after):
            return model.generate(**sample, **self.kwargs())

    @staticmethod
    def prompt(sample: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A training sample as a prompt: its ``input_ids`` and ``attention_mask`` (ones when it has
        none: no padding), without the labels (``generate`` would hand them to every call)."""
        ids = sample["input_ids"]
        return {"input_ids": ids, "attention_mask": sample.get("attention_mask", torch.ones_like(ids))}

    def __str__(self) -> str:
        return f"model.generate({', '.join(f'{k}={v!r}' for k, v in self.kwargs().items())})"


class MasterWeights:
    """fp32 master weights for low-precision parameters (the recipe of apex's O2 / Megatron's
    ``Float16OptimizerWithFloat16Params``): the optimizer updates fp32 copies of the parameters,
    and its state is fp32; at ``step()`` every gradient is copied to fp32 first (all alive
    during the update), then the masters are copied back into the parameters.

    ``state[p]`` is ``{"master": the fp32 copy, **the inner optimizer's state of it}`` (what
    ``state_tensors`` and the estimator read as optimizer state of ``p``)."""

    def __init__(self, params, factory: OptimizerFactory):
        self.params = [p for p in params if p.requires_grad]
        # copy=True: copies even of fp32 parameters (the w = 4 point of report(dtype_symbols=True))
        self.masters = [nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in self.params]
        self.inner = factory(self.masters)
        self.param_groups = [{**group, "params": self.params} for group in self.inner.param_groups[:1]]
        self.defaults = self.inner.defaults

    @property
    def state(self) -> dict:
        return {p: {"master": m, **self.inner.state.get(m, {})} for p, m in zip(self.params, self.masters)}

    def step(self, closure=None):
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.to(torch.float32, copy=True)
        self.inner.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
        for m in self.masters:
            m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def master_weights(factory: OptimizerFactory) -> OptimizerFactory:
    """``factory`` behind fp32 master weights (``MasterWeights``)."""
    return lambda params: MasterWeights(params, factory)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


class Prepared(NamedTuple):
    optimizer: torch.optim.Optimizer | None
    scaler: torch.amp.GradScaler | None


def prepare(
    model: nn.Module, mode: Mode, optimizer: OptimizerFactory | None, precision: Precision = FP32
) -> Prepared:
    """Put ``model`` in the mode's train/eval state and build its optimizer and, with
    ``precision.grad_scaler``, its ``GradScaler`` (train only).  The scaler's ``_scale`` and
    ``_growth_tracker`` are created lazily by its first ``scale()``: by the warm-up step."""
    model.train(mode is Mode.TRAIN)
    if mode is not Mode.TRAIN:
        return Prepared(None, None)
    scaler = GradScaler(device_type(model)) if precision.grad_scaler else None
    if optimizer is None:
        return Prepared(None, scaler)
    if not trainable(model):
        raise InputError("mode='train' but no parameter requires grad: nothing to train")
    # Every parameter, as users write it (torch.optim.Adagrad(model.parameters())): frozen ones
    # get no state from optimizers that create it lazily, but Adagrad creates it in __init__.
    opt = _built(optimizer, list(model.parameters()))
    if not isinstance(opt, (torch.optim.Optimizer, MasterWeights)):
        raise InputError(f"the optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
    return Prepared(opt, scaler)


def _built(factory: Callable, argument) -> Any:
    """``factory(argument)``; what the user's factory raises becomes an ``InputError`` naming it
    (not "the model could not be run")."""
    try:
        return factory(argument)
    except InputError:
        raise
    except Exception as exc:
        name = getattr(factory, "__qualname__", type(factory).__name__)
        raise InputError(f"the optimizer factory {name} raised {type(exc).__name__}: {exc}".rstrip(": ")
                         + _where(exc)) from exc


def state_factory(optimizer: str | StateFactory | None) -> StateFactory | None:
    """``report(step=, optimizer=)``'s factory, ``model -> state``: a callable as given (the user
    builds what the step is handed: an optimizer over ``model.parameters()``, or a tuple/dict of
    optimizers, an EMA copy, a ``GradScaler``); a name: that optimizer over every parameter of
    the model (``torch.optim.AdamW(model.parameters())``)."""
    if optimizer is None or callable(optimizer):
        return optimizer
    make = optimizer_factory(optimizer)
    return lambda model: make(list(model.parameters()))


def user_state(model: nn.Module, mode: Mode, factory: StateFactory | None) -> Any:
    """Put ``model`` in the mode's train/eval state and build the state the user's step is
    handed (train; None in inference or without a factory)."""
    model.train(mode is Mode.TRAIN)
    if mode is not Mode.TRAIN or factory is None:
        return None
    return _built(factory, model)


def instances_in(state: Any, cls: type) -> list:
    """The ``cls`` objects in a user step's state: the state itself, or inside its tuples, lists,
    dicts and the attributes of plain objects (each once, in order)."""
    found: dict[int, Any] = {}

    def walk(value, depth: int) -> None:
        if isinstance(value, cls):
            found.setdefault(id(value), value)
        elif depth > 4 or isinstance(value, (torch.Tensor, nn.Module, str, bytes, type, *_NOT_STATE)):
            return
        elif isinstance(value, Mapping):
            for v in list(value.values()):
                walk(v, depth + 1)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, depth + 1)
        elif hasattr(value, "__dict__"):
            for v in list(vars(value).values()):
                walk(v, depth + 1)

    walk(state, 0)
    return list(found.values())


def optimizers_in(state: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in a user step's state (``instances_in``)."""
    return instances_in(state, torch.optim.Optimizer)


def user_state_tensors(model: nn.Module, state: Any, sample: Any) -> dict[Category, dict[str, torch.Tensor]]:
    """The tensors alive before a user's step, by category: ``state_tensors`` plus the gradients
    a previous step left (``zero_grad(set_to_none=False)``, or zeroing at the start of the step),
    the state of every optimizer in ``state`` (``optimizers_in``) and the other tensors ``state``
    holds (an EMA copy's weights, a ``GradScaler``'s scale), counted as optimizer state."""
    found = state_tensors(model, None, sample)
    grads = found[Category.GRADIENT] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:  # a DTensor's is its local shard (FSDP2's: views of one reduce-scatter output)
            grads.update(_plain(f"{name}.grad", p.grad))
    optimizers = optimizers_in(state)
    param_names = {id(p): name for name, p in model.named_parameters()}
    states = found[Category.OPTIMIZER_STATE]
    for i, opt in enumerate(optimizers):
        prefix = f"optimizer{i}." if len(optimizers) > 1 else ""
        for param, values in opt.state.items():
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    states.update(_plain(f"{prefix}{param_names.get(id(param), 'param')}.{key}", value))
    known = {id(t) for tensors in found.values() for t in tensors.values()}
    states.update({name: t for name, t in _tensors_in({"state": state}, known).items()})
    return found


def _where(exc: BaseException) -> str:
    """`` (at file:line)`` of the innermost frame of ``exc`` outside torch and fxmem."""
    import os
    import traceback

    internal = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if not frame.filename.startswith(internal):
            return f" (at {frame.filename}:{frame.lineno} in {frame.name}: {frame.line})"
    return ""


def run(
    model,
    sample,
    mode: Mode,
    optimizer,
    loss_fn: LossFn,
    on_phase: PhaseCallback = lambda phase: None,
    precision: Precision = FP32,
    scaler: torch.amp.GradScaler | None = None,
    strategy: Strategy = DEFAULT,
    batch_dims: tuple[int, ...] | None = None,
    keep_output: bool = True,
):
    """Run the step of ``mode`` (the model already prepared; ``scaler`` from ``prepare``;
    ``batch_dims`` where accumulation splits the sample, see ``train_step``)."""
    if mode is Mode.TRAIN:
        return train_step(model, sample, optimizer, loss_fn, on_phase, precision, scaler, strategy, batch_dims,
                          keep_output)
    if strategy.accumulate > 1 or strategy.checkpoint is not None:
        raise InputError("gradient accumulation and activation checkpointing apply to mode='train' only")
    return inference_step(model, sample, on_phase, precision)


def scaler_state(scaler: torch.amp.GradScaler | None) -> dict[str, torch.Tensor]:
    """The scaler's persistent tensors (a 0-dim fp32 scale and int32 growth counter, 4 B each,
    on the step's device), once its first ``scale()`` created them."""
    if scaler is None:
        return {}
    state = {"grad_scaler._scale": scaler._scale, "grad_scaler._growth_tracker": scaler._growth_tracker}
    return {name: t for name, t in state.items() if isinstance(t, torch.Tensor)}


def state_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, sample: Any, scaler: torch.amp.GradScaler | None = None
):
    """The tensors alive before a step starts, by category, each ``{name: tensor}`` (without
    gradients: the step ends with ``zero_grad(set_to_none=True)``).

    The tensors the model holds outside its parameters and buffers (``held_tensors``) count as
    buffers; the ``GradScaler``'s scale and growth tracker count as optimizer state.
    """
    params = {k: t for name, p in model.named_parameters() for k, t in _plain(name, p).items()}
    buffers = {k: t for name, b in model.named_buffers() for k, t in _plain(name, b).items()}
    buffers.update(held_tensors(model))
    states = {}
    if optimizer is not None:
        param_names = {id(p): name for name, p in model.named_parameters()}
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    states.update(_plain(f"{param_names.get(id(param), 'param')}.{key}", value))
    states.update(scaler_state(scaler))
    inputs = tree_flatten(sample)[0]
    return {
        Category.PARAMETER: params,
        Category.BUFFER: buffers,
        Category.OPTIMIZER_STATE: states,
        Category.INPUT: {f"input{i}": t for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)},
    }


def _plain(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """``t`` by name, or, for a tensor subclass that wraps others (torchao's quantized optimizer
    states: ``codes``, ``scale``; an NF4 weight), the tensors that hold its memory, named
    ``name.attr``.  A DTensor is its local shard, under its own name.  A
    parameter of a ``Parameter`` subclass comes with the tensors its Python attributes hold
    (bitsandbytes' ``Params4bit``: the ``quant_state``'s block scales and code), named
    ``name.attr...``: memory of the weight."""
    if (shard := world.local(t)) is not t:
        return _plain(name, shard)
    if not is_traceable_wrapper_subclass(t):
        return {name: t, **parameter_attribute_tensors(name, t)}
    return {k: x for attr, inner in wrapped(t).items() for k, x in _plain(f"{name}.{attr}", inner).items()}


COPIED_ATTRIBUTES = "_fxmem_parameter_attributes"  # on a fake parameter: the names it was given (fake_model)


def parameter_attributes(p: torch.Tensor) -> dict[str, Any]:
    """The Python attributes of a parameter of a ``Parameter`` subclass (``Params4bit``'s
    ``quant_state``, ``blocksize``, ``module`` …), which a fake copy must keep, and those the fake
    copy was given (``COPIED_ATTRIBUTES``: a fake parameter is a ``FakeTensor`` flagged as a
    parameter, whose own attributes are the fake mode's); {} for others."""
    kind = type(p)
    if kind is not nn.Parameter and issubclass(kind, nn.Parameter):
        return dict(vars(p))
    names = p.__dict__.get(COPIED_ATTRIBUTES, ()) if isinstance(p, FakeTensor) else ()
    return {name: p.__dict__[name] for name in names}


def parameter_attribute_tensors(name: str, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors ``parameter_attributes(p)`` hold, outside modules, by path from ``name``."""
    held = {k: v for k, v in parameter_attributes(p).items() if not isinstance(v, nn.Module)}
    return _tensors_in({name: held}, {id(p)}) if held else {}


# Module attributes that are torch's bookkeeping (hook dicts, the parameter/buffer/submodule
# dicts themselves), not state the model holds.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
_NOT_STATE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
              types.BuiltinMethodType, torch.dtype, torch.device)


def held_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors ``model`` holds besides its parameters and registered buffers, by path: plain
    tensor attributes of its modules, tensors in lists, tuples, dicts and sets, on helper objects
    that are not modules, and the parameters and buffers of modules it keeps outside its module
    tree (in a plain list); not a parameter's own (``Params4bit``'s ``quant_state``).  Each once.

    Real memory of every step, as buffers are (what fxmem counts them as).
    """
    modules = dict(model.named_modules())
    seen = {id(t) for t in [*model.parameters(), *model.buffers()]} | {id(m) for m in modules.values()}
    seen |= {id(t) for name, p in model.named_parameters() for t in parameter_attribute_tensors(name, p).values()}
    return _tensors_in(modules, seen, module_tree=True)


def tensors_in(obj: Any) -> dict[str, torch.Tensor]:
    """The tensors an object holds (a KV cache: its layers' keys and values), by attribute path."""
    return _tensors_in({"": obj}, set())


def _tensors_in(roots: dict[str, Any], seen: set[int], module_tree: bool = False) -> dict[str, torch.Tensor]:
    """The tensors reachable from ``roots`` (by path) through containers, object attributes and
    modules, each once, skipping the ids in ``seen`` and optimizers (their state is named by
    parameter).  ``module_tree``: the roots are the model's own modules, whose parameters,
    buffers and submodules are known already (only their other attributes are walked)."""
    seen = set(seen)
    found: dict[str, torch.Tensor] = {}

    def walk(value, path: str, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            if id(value) not in seen:
                seen.add(id(value))
                found.update(_plain(path, value))
            return
        if depth > 8 or id(value) in seen or isinstance(value, (str, bytes, int, float, complex, bool, type(None))):
            return
        if isinstance(value, (*_NOT_STATE, torch.optim.Optimizer)):
            return
        seen.add(id(value))
        if isinstance(value, dict):
            for k, v in list(value.items()):
                walk(v, f"{path}[{k!r}]", depth + 1)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]", depth + 1)
        elif isinstance(value, (set, frozenset)):
            for i, v in enumerate(value):
                walk(v, f"{path}{{{i}}}", depth + 1)
        elif isinstance(value, nn.Module):  # a module outside the model's tree: everything it holds
            for name, t in [*value._parameters.items(), *value._buffers.items()]:
                walk(t, f"{path}.{name}", depth + 1)
            for name, sub in value._modules.items():
                walk(sub, f"{path}.{name}", depth + 1)
            attributes(value, path, depth + 1)
        elif hasattr(value, "__dict__"):
            attributes(value, path, depth + 1)

    def attributes(obj, prefix: str, depth: int) -> None:
        for attr, v in list(vars(obj).items()):
            if isinstance(obj, nn.Module) and attr in _MODULE_INTERNALS:
                continue
            walk(v, f"{prefix}.{attr}" if prefix else attr, depth)

    for prefix, root in roots.items():
        if module_tree:
            attributes(root, prefix, 0)
        else:
            walk(root, prefix, 0)
    return found
