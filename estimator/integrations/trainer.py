"""Hugging Face ``transformers.Trainer``'s own optimizer step, for ``estimator.report(step=, optimizer=)``.

``trainer_step()`` is the step Trainer runs for one optimizer step (the outputs dropped before
backward, the gradient norm and clipping at ``max_grad_norm``, ``zero_grad`` to None) and
``trainer_optimizer()`` the state it keeps (its default fused AdamW in two weight-decay groups,
the scheduler, its loss and norm tensors)::

    rep = estimator.report(model, batch, step=trainer_step(max_grad_norm=1.0), optimizer=trainer_optimizer())

(``args=TrainingArguments(...)`` for both takes the settings from your arguments:
``training_settings`` reads them into a ``TrainerSettings`` and refuses by name what fxmem does
not model).  All at once, from the arguments you give ``Trainer``:
``estimator.integrations.training_args.from_training_args``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import torch
from torch import nn

from estimator.integrations._common import import_optional, suggest
from estimator.vocab.errors import InputError

# -- Hugging Face ``Trainer``'s own optimizer step: report(step=trainer_step(), optimizer=trainer_optimizer()) --
#
# What transformers 5.24's ``Trainer`` runs for one optimizer step (``Trainer._run_epoch``,
# ``training_step``, ``compute_loss``, with accelerate 1.x's ``Accelerator.backward`` and
# ``clip_grad_norm_``), one micro-batch per step, fp32, one process:
#
#   num_items = sum(labels.ne(-100).sum() ...) / 1        # get_batch_samples (loss-kwargs models)
#   loss = model(**batch, num_items_in_batch=num_items)["loss"]   # compute_loss: outputs dropped
#   loss *= 1                                             # average_tokens_across_devices (default)
#   (loss / 1).backward()                                 # Accelerator.backward: / accumulation steps
#   tr_loss_step = loss.detach(); isnan/isinf; _tr_loss += tr_loss_step
#   grad_norm = clip(model.parameters(), max_grad_norm)   # always: max_norm=inf when clipping is off
#   optimizer.step(); lr_scheduler.step(); model.zero_grad()   # zero_grad: set_to_none=True
#
# and the optimizer ``create_optimizer`` builds: ``torch.optim.AdamW`` (``fused=True`` for the
# default ``optim="adamw_torch_fused"`` on torch >= 2.8) over the trainable parameters in two
# groups, with and without weight decay.

# ``Trainer.get_decay_parameter_names``'s name patterns (transformers 5.24, trainer.py): no weight
# decay for biases, norms, and every parameter inside an ``nn.LayerNorm``.
_NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
_IGNORE_INDEX = -100  # the label transformers' losses skip (and Trainer does not count)
# TrainingArguments fields that change the memory of Trainer's step and that the mapping does not
# model (``from_training_args``, ``trainer_step(args=)``): set to anything but their default, they
# raise ``InputError`` naming the field.  Fields not listed either are mapped (``training_settings``)
# or do not change one training step's memory (logging, saving, evaluation, the hub, seeds).
_UNMODELLED_ARGS = {
    "label_smoothing_factor": "Trainer's LabelSmoother computes the loss outside the model",
    "use_liger_kernel": "Liger's fused kernels replace the model's modules",
    "neftune_noise_alpha": "NEFTune's embedding-noise hook",
    "torch_empty_cache_steps": "empty_cache() inside the step changes what the allocator reserves",
    "include_num_input_tokens_seen": "the token counting tensors made after each micro-batch",
    "optim_target_modules": "GaLore / APOLLO projections of the target modules",
    "parallelism_config": "tensor / context / sequence parallelism",
    "label_names": "labels under other names than 'labels'",
    "debug": "debug hooks (underflow_overflow)",
    "full_determinism": "deterministic algorithms (their own workspaces)",
}
# ``optim`` values the mapping models: each is built by Trainer's own ``get_optimizer_cls_and_kwargs``
# and captured as it runs; the low-bit ones where their library imports (``LOW_BIT_OPTIMS``).
LOW_BIT_OPTIMS = {
    **dict.fromkeys(("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "lion_8bit",
                     "paged_lion_8bit"), "bitsandbytes"),
    **dict.fromkeys(("adamw_torch_8bit", "adamw_torch_4bit"), "torchao"),
}
MODELLED_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop", *LOW_BIT_OPTIMS)


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """What ``from_training_args`` reads from a ``TrainingArguments`` (``training_settings``).

    ``micro_batch`` is ``per_device_train_batch_size`` and ``accumulate`` is
    ``gradient_accumulation_steps``: fxmem's ``b``, the batch of one optimizer step on one
    device, is their product (``batch``).  ``amp``: accelerate's autocast dtype (``"bf16"``,
    ``"fp16"`` on CUDA; None: fp32), ``grad_scaler``: fp16's ``GradScaler``.  ``checkpointing``:
    the keywords Trainer passes to ``model.activation_checkpointing_enable`` (None: off).
    ``strategy``: the ``Strategy`` of the run (``accumulate``, and data parallelism or sharding
    over ``world_size`` devices)."""

    micro_batch: int
    accumulate: int
    max_grad_norm: float | None
    amp: str | None
    grad_scaler: bool
    checkpointing: dict[str, Any] | None
    optim: str
    use_cache: bool
    nan_inf_filter: bool
    strategy: Any
    notes: tuple[str, ...] = ()

    @property
    def batch(self) -> int:
        return self.micro_batch * self.accumulate


@dataclasses.dataclass
class TrainerLoop:
    """What transformers' ``Trainer`` keeps from one optimizer step to the next, device tensors
    only: the optimizer (and its state), the learning-rate scheduler, ``_tr_loss`` (the losses
    summed between two logging steps, fp32 0-dim), the last step's detached loss
    (``tr_loss_step``) and gradient norm (``grad_norm``): both alive until the next step
    replaces them, after its backward and before its clipping; with fp16, accelerate's
    ``GradScaler`` (its scale and growth tracker).  ``trainer_optimizer()`` builds it;
    ``trainer_step()`` updates it (mutable: it is the loop's state, not a result)."""

    optimizer: torch.optim.Optimizer
    lr_scheduler: Any = None
    tr_loss: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    grad_norm: torch.Tensor | None = None
    scaler: Any = None


def trainer_step(max_grad_norm: float | None = 1.0, *, accumulate: int = 1, amp: str | None = None,
                 device: str = "cpu", nan_inf_filter: bool = True, args: Any = None):
    """The step transformers' ``Trainer`` runs for one optimizer step, as a ``report(step=)``
    function ``step(model, batch, state)``: ``batch`` a dict of tensors (``model(**batch)``, as
    the data collator makes it: each key its own tensor), ``state`` what ``trainer_optimizer()``
    builds (a ``TrainerLoop``; an optimizer or ``(optimizer, lr_scheduler)`` works too, without
    the loss and norm kept between steps).

    Follows transformers 5.24 (``Trainer._run_epoch``, ``get_batch_samples``, ``training_step``,
    ``compute_loss``, ``_get_num_items_in_batch``) with accelerate 1.x (``prepare_model``'s
    autocast, ``Accelerator.backward``, ``clip_grad_norm_``), one process:

    - ``accumulate`` micro-batches per optimizer step (``gradient_accumulation_steps``): the
      batch holds all of them (``get_batch_samples`` fetches them before the step; they stay in
      its list to the end) and is split into ``accumulate`` equal micro-batches
      (``estimator.capture.steps.micro_batches``: views).  With ``accumulate > 1`` pass
      ``report(strategy=Strategy(accumulate=accumulate))`` too: ``b`` is then the optimizer
      step's batch and the capture's symbol the micro-batch (without it the split is refused);
    - for models that take loss kwargs (``accepts_loss_kwargs``, else ``**kwargs`` in
      ``forward``; a PEFT model's base model) and a batch with ``labels``:
      ``num_items_in_batch``, the labels that are not -100 in all the micro-batches
      (``labels[..., 1:]`` for causal-LM losses), passed to the model;
    - per micro-batch: ``loss = model(**inputs)["loss"]`` (``outputs[0]`` for tuples): the
      outputs, logits included, die before backward (the built-in step's
      ``keep_output=False``); with ``amp`` the model's forward runs under
      ``torch.autocast(device, dtype)`` and its floating-point outputs are copied to fp32
      (accelerate's ``convert_outputs_to_fp32``); the loss scaled as Trainer and accelerate do
      (``loss *= 1`` in place, or ``loss / accumulate`` when it is not normalised by
      ``num_items_in_batch``; then accelerate's ``loss / 1``) and ``backward()`` (through the
      ``GradScaler`` with fp16); the detached loss tested for nan/inf
      (``logging_nan_inf_filter``) and added in place to ``_tr_loss``;
    - the gradient norm, every step: with fp16 the gradients unscaled first
      (``scaler.unscale_``), clipped to ``max_grad_norm`` when that is > 0, else computed with
      ``max_norm=inf`` (Trainer's ``_get_grad_norm``), as accelerate does it
      (``torch.nn.utils.get_total_norm`` per device mesh, ``stack`` and 2-norm of those, then
      ``clip_grads_with_norm_``; ``foreach=None``: foreach kernels where the device has them);
    - ``optimizer.step()`` (``scaler.step`` + ``scaler.update()`` with fp16),
      ``lr_scheduler.step()`` (plain Python: no tensor), and ``model.zero_grad()``
      (``set_to_none=True``: no gradient outlives the step).

    ``max_grad_norm``: ``TrainingArguments.max_grad_norm`` (default 1.0; None or 0: no clipping,
    the norm is still computed).  ``amp``: ``"bf16"`` or ``"fp16"`` (None: fp32); ``device``: the
    target (``report(device=)``), whose autocast accelerate enters.  ``args``: a
    ``TrainingArguments`` to take all of these from instead (``training_settings``; activation
    checkpointing changes the model, not the step: ``from_training_args`` applies it).

    Not part of the step: the next micro-batch, which accelerate's ``DataLoaderShard`` fetches
    one ahead (host memory: on a CPU run one more micro-batch is alive, which ``from_training_args``
    counts; on a GPU it waits on the host), and ``num_items_in_batch`` being computed before the
    step rather than in it.
    """
    if args is not None:
        settings = training_settings(args, device=device)
        if settings.checkpointing is not None:
            raise InputError("activation_checkpointing=True changes the model (activation_checkpointing_enable), "
                             "not the step: use from_training_args(model, args), which enables it on a copy")
        max_grad_norm, accumulate, amp = settings.max_grad_norm, settings.accumulate, settings.amp
        nan_inf_filter = settings.nan_inf_filter
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))):
        raise InputError(f"max_grad_norm must be a number or None, got {max_grad_norm!r}")
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise InputError(f"accumulate must be a positive int, got {accumulate!r}")
    if amp not in (None, "bf16", "fp16"):
        raise InputError(f"amp must be 'bf16', 'fp16' or None, got {amp!r}")
    device_type = device_type_of(device)
    max_norm = float(max_grad_norm) if max_grad_norm is not None and max_grad_norm > 0 else float("inf")
    k = accumulate
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[amp]

    def forward(model: nn.Module, inputs: dict[str, Any]):
        if autocast_dtype is None:
            return model(**inputs)
        from accelerate.utils.operations import convert_to_fp32

        with torch.autocast(device_type=device_type, dtype=autocast_dtype):
            outputs = model(**inputs)
        return convert_to_fp32(outputs)

    def step(model: nn.Module, batch: dict[str, torch.Tensor], state: Any) -> None:
        if not isinstance(batch, dict):
            raise InputError(f"trainer_step's batch must be a dict of tensors (model(**batch)), got "
                             f"{type(batch).__name__}")
        if state is None and not model.training:  # report(mode="inference") hands no state, model in eval mode
            raise InputError("trainer_step is Trainer's training step: use it with mode='train'")
        loop = _trainer_loop(state)
        batch_samples = split_micro_batches(batch, k)  # get_batch_samples' list: alive to the end of the step
        num_items = _num_items_in_batch(model, batch_samples) if _accepts_loss_kwargs(model) else None
        model.train()
        for inputs in batch_samples:
            inputs = {**inputs, "num_items_in_batch": num_items} if num_items is not None else inputs
            outputs = forward(model, inputs)
            if isinstance(outputs, dict) and "loss" not in outputs:
                raise InputError(f"{type(model).__name__} returned no loss: Trainer's step needs labels in the "
                                 f"batch (it holds {', '.join(batch)})")
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
            del outputs, inputs
            if num_items is not None:
                loss *= 1  # compute_loss: average_tokens_across_devices, * num_processes // tp_size
            else:
                loss = loss / k  # training_step: a loss not normalised by num_items, / accumulation steps
            # Accelerator.backward: its local `loss / gradient_accumulation_steps` (1), scaled with fp16;
            # training_step returns the loss before that division, detached.
            ((loss / 1) if loop.scaler is None else loop.scaler.scale(loss / 1)).backward()
            loop.loss = loss.detach()  # tr_loss_step: the previous micro-batch's dies here
            del loss
            if nan_inf_filter:
                torch.isnan(loop.loss)  # logging_nan_inf_filter: `isnan(x) or isinf(x)`, 1 byte each
                torch.isinf(loop.loss)
            if loop.tr_loss is not None:
                loop.tr_loss += loop.loss
        loop.grad_norm = None  # `grad_norm = None` before clipping
        if loop.scaler is not None and loop.optimizer is not None:
            loop.scaler.unscale_(loop.optimizer)  # Accelerator.clip_grad_norm_: unscale_gradients()
        loop.grad_norm = _clip_grad_norm(list(model.parameters()), max_norm)
        if loop.optimizer is not None:
            if loop.scaler is not None:
                loop.scaler.step(loop.optimizer)  # AcceleratedOptimizer.step
                loop.scaler.update()
            else:
                loop.optimizer.step()
        if loop.lr_scheduler is not None:
            loop.lr_scheduler.step()
        model.zero_grad()

    step.__qualname__ = step.__name__ = "trainer_step"
    return step


def device_type_of(device: Any) -> str:
    name = device.type if isinstance(device, torch.device) else str(device).strip().lower().partition(":")[0]
    if name not in ("cpu", "cuda"):
        raise InputError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return name


def split_micro_batches(batch: dict[str, torch.Tensor], k: int) -> list[dict[str, torch.Tensor]]:
    """``batch`` as ``k`` equal micro-batches (views); refused where dim 0 does not split in ``k``
    (a symbolic size ``k*m`` does: ``report(strategy=Strategy(accumulate=k))``)."""
    from estimator.capture.steps import micro_batches

    if k == 1:
        return [batch]
    for key, t in batch.items():
        if isinstance(t, torch.Tensor) and t.dim() and not _divides(k, t.shape[0]):
            raise InputError(f"trainer_step(accumulate={k}): batch[{key!r}] has {t.shape[0]} rows, not k micro-batches "
                             f"of equal size; with report() pass strategy=Strategy(accumulate={k}) so that b is the "
                             "optimizer step's batch (from_training_args does)")
    return micro_batches(batch, k)


def _divides(k: int, size: Any) -> bool:
    """Whether ``k`` divides ``size``, an int or a ``SymInt`` (a polynomial in the capture's
    symbols: every coefficient), without a guard on the symbol."""
    if not isinstance(size, torch.SymInt):
        return int(size) % k == 0
    import sympy

    expr = sympy.expand(size.node.expr)
    if not expr.free_symbols:
        return int(expr) % k == 0
    return all(sympy.Integer(c) % k == 0 for c in sympy.Poly(expr, *sorted(expr.free_symbols, key=str)).coeffs())


def trainer_optimizer(
    optim: str | None = None,
    *,
    learning_rate: float = 5e-5,
    weight_decay: float = 0.0,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.999,
    adam_epsilon: float = 1e-8,
    lr_scheduler_type: str | None = "linear",
    max_steps: int = 1000,
    device: str = "cpu",
    args: Any = None,
):
    """``report(optimizer=)`` factory ``model -> TrainerLoop``: the optimizer and scheduler
    ``Trainer.create_optimizer`` / ``create_scheduler`` build (transformers 5.24) and ``_tr_loss``.

    The optimizer: ``torch.optim.AdamW`` over the trainable parameters in two groups, those
    ``Trainer.get_decay_parameter_names`` names (``weight_decay``) and the rest (biases, norms,
    ``nn.LayerNorm`` parameters: 0.0); ``fused=True`` for ``optim="adamw_torch_fused"``, the
    ``TrainingArguments`` default on torch >= 2.8 (``optim=None``: that default), torch's own
    choice (foreach on CUDA, a for-loop on CPU) for ``"adamw_torch"``.  The scheduler:
    transformers' ``get_scheduler(lr_scheduler_type)`` (None: none); it allocates no tensor.

    ``args``: a ``TrainingArguments``: its optimizer (an ``optim`` of ``MODELLED_OPTIMS``, built by
    Trainer's own ``get_optimizer_cls_and_kwargs``), weight decay and scheduler instead of the
    keywords, and with ``fp16`` on the CUDA target (``device``) accelerate's ``GradScaler``.
    """
    scaler = False
    if args is not None:
        args = training_arguments(args)
        scaler = training_settings(args, device=device).grad_scaler
    elif optim is None:
        optim = _default_optim()
    elif optim not in ("adamw_torch", "adamw_torch_fused"):
        raise InputError(f"trainer_optimizer builds optim='adamw_torch' or 'adamw_torch_fused', got {optim!r}: "
                         "pass args=TrainingArguments(optim=...) for Trainer's other optimizers")

    def build_loop(model: nn.Module) -> TrainerLoop:
        groups = _parameter_groups(model, args.weight_decay if args is not None else weight_decay)
        if args is not None:
            cls, kwargs = import_transformers().Trainer.get_optimizer_cls_and_kwargs(args, model)
            optimizer = _trainer_built(cls, dict(kwargs), groups, model)
            scheduler_type, steps = args.lr_scheduler_type, args.max_steps if args.max_steps > 0 else max_steps
            warmup = args.get_warmup_steps(steps)
        else:
            fused = {"fused": True} if optim == "adamw_torch_fused" else {}
            optimizer = torch.optim.AdamW(groups, lr=learning_rate, betas=(adam_beta1, adam_beta2), eps=adam_epsilon,
                                          **fused)
            scheduler_type, steps, warmup = lr_scheduler_type, max_steps, 0
        scheduler = None
        if scheduler_type is not None:
            scheduler = import_transformers().get_scheduler(scheduler_type, optimizer=optimizer,
                                                            num_warmup_steps=warmup, num_training_steps=steps)
        where = next((p.device for p in model.parameters()), torch.device("cpu"))
        grad_scaler = torch.amp.GradScaler(device_type_of(device)) if scaler else None  # accelerate's get_grad_scaler
        return TrainerLoop(optimizer, scheduler, tr_loss=torch.tensor(0.0, device=where), scaler=grad_scaler)

    build_loop.__qualname__ = build_loop.__name__ = "trainer_optimizer"
    return build_loop


def _trainer_built(cls, kwargs: dict[str, Any], groups: list[dict[str, Any]], model: nn.Module):
    """The optimizer ``Trainer.create_optimizer`` makes of ``get_optimizer_cls_and_kwargs``'s
    answer: a factory (Muon, Dion) called with the model, else the class with the parameter groups,
    unless the keywords bring their own ``params``, ``model`` or ``optimizer_dict`` (GaLore, LOMO,
    layer-wise optimizers)."""
    try:
        from transformers.trainer_optimizer import is_optimizer_factory
    except ImportError:
        is_optimizer_factory = None
    if is_optimizer_factory is not None and is_optimizer_factory(cls):
        return cls()(model, **kwargs)
    for key in ("params", "model", "optimizer_dict"):
        if key in kwargs:
            groups = kwargs.pop(key)
    optimizer = cls(groups, **kwargs)
    if "bitsandbytes" in str(cls) and kwargs.get("optim_bits") == 8:
        # trainer.py create_optimizer: an 8-bit bitsandbytes optimizer keeps 32-bit state for every
        # nn.Embedding's weight (bitsandbytes' GlobalOptimManager override, read at its first step;
        # the capture puts the manager back as it was, ``isolation.optimizer_overrides_kept``)
        import bitsandbytes

        manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                manager.register_module_override(module, "weight", {"optim_bits": 32})
    return optimizer


def import_transformers():
    """``transformers``, imported the way ``build`` does (torchvision made importable first), or
    an ``InputError`` naming the extra to install."""
    return import_optional("transformers", "transformers")


def _default_optim() -> str:
    """``TrainingArguments``' default ``optim``: ``adamw_torch_fused`` on torch >= 2.8 (transformers
    5.24, training_args.py ``default_optim``), else ``adamw_torch``."""
    try:
        return str(import_transformers().TrainingArguments.default_optim)
    except (InputError, ImportError, AttributeError):
        major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
        return "adamw_torch_fused" if (major, minor) >= (2, 8) else "adamw_torch"


def training_arguments(args: Any):
    """``args`` as a ``transformers.TrainingArguments``: one already, a dict of its fields, or the
    path of a JSON file holding them (``output_dir`` may be left out; built with ``use_cpu=True``:
    the target is ``report(device=)``, not this machine).  A field it does not have,
    or one set to a value fxmem does not model before ``TrainingArguments`` would need it (a
    DeepSpeed config: building it imports ``deepspeed``), raises ``InputError``."""
    transformers = import_transformers()
    if isinstance(args, transformers.TrainingArguments):
        return args
    if isinstance(args, (str, os.PathLike)):
        path = os.path.expanduser(os.fspath(args))
        try:
            with open(path) as f:
                fields = json.load(f)
        except FileNotFoundError:
            raise InputError(f"no such TrainingArguments file: {path!r}") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise InputError(f"cannot read TrainingArguments from {path!r}: {exc}") from exc
        if not isinstance(fields, dict):
            raise InputError(f"{path!r} must hold a JSON object of TrainingArguments fields, got "
                             f"{type(fields).__name__}")
    elif isinstance(args, dict):
        fields = dict(args)
    else:
        raise InputError(f"args must be a transformers.TrainingArguments, a dict of its fields or the path of a "
                         f"JSON file holding them, got {type(args).__name__}")
    known = {f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init}
    unknown = [k for k in fields if k not in known]
    if unknown:
        hints = "".join(suggest(k, sorted(known), n=2) for k in unknown)
        raise InputError(f"TrainingArguments has no field {', '.join(map(repr, unknown))}.{hints}")
    if fields.get("deepspeed"):
        _refuse_deepspeed(fields["deepspeed"], world_size=None)
    fields.setdefault("output_dir", "fxmem-unused")
    fields.setdefault("report_to", "none")
    # The target is report(device=), not this machine: with use_cpu a machine without a GPU reads a GPU
    # run's arguments (TrainingArguments refuses bf16=True there otherwise).
    fields["use_cpu"] = True
    try:
        return transformers.TrainingArguments(**fields)
    except (TypeError, ValueError, ImportError) as exc:
        raise InputError(f"TrainingArguments({', '.join(f'{k}={v!r}' for k, v in fields.items())}) failed: "
                         f"{exc}") from exc


def training_settings(args: Any, *, device: str = "cpu", world_size: int = 1) -> TrainerSettings:
    """What ``from_training_args`` reads from ``args`` (``training_arguments``) for a run on the
    ``device`` target over ``world_size`` devices: ``TrainerSettings``.  A field set to a value
    fxmem does not model raises ``InputError`` naming the field and the value.

    - ``per_device_train_batch_size`` × ``gradient_accumulation_steps``: ``b``, with
      ``Strategy(accumulate=gradient_accumulation_steps)``;
    - ``bf16``: accelerate's autocast (bf16, any device); ``fp16``: autocast and a ``GradScaler``
      on CUDA; on the CPU accelerate leaves fp16 off (``Accelerator``: native AMP for fp16 needs
      another device), so the step is fp32 (noted);
    - ``activation_checkpointing`` (or the deprecated ``gradient_checkpointing``) and their
      ``*_kwargs``: what Trainer passes to ``model.activation_checkpointing_enable``
      (``every_n_layers`` and the ``torch.utils.checkpoint`` keywords; ``offload`` is refused);
    - ``optim``: one of ``MODELLED_OPTIMS`` (the low-bit ones: bitsandbytes or torchao installed);
    - ``max_grad_norm``, ``logging_nan_inf_filter``, ``use_cache`` (Trainer sets the model's
      ``config.use_cache`` to it);
    - ``torch_compile`` (``torch_compile_mode``; Inductor): ``Strategy(compile=)``, the model
      estimated as compiled;
    - ``fsdp`` (FSDP2 ``fully_shard`` of the model's blocks: ``reshard_after_forward`` True, or
      the legacy ``"full_shard"`` -> ZeRO-3, False or ``"shard_grad_op"`` -> ZeRO-2, over
      ``world_size`` devices), and DDP when ``world_size`` > 1: ``strategy``.  DeepSpeed, FSDP1,
      CPU offload, FSDP's own checkpointing and other wrap policies are refused.
    """
    from estimator.vocab.strategy import Strategy

    args = training_arguments(args)
    device = device_type_of(device)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world_size must be a positive int, got {world_size!r}")
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"TrainingArguments {name}={value!r}: must be a positive int")
    defaults = import_transformers().TrainingArguments(output_dir="fxmem-unused", report_to="none", use_cpu=True)
    changed = [(name, getattr(args, name), why) for name, why in _UNMODELLED_ARGS.items()
               if getattr(args, name, None) != getattr(defaults, name, None)]
    if changed:
        name, value, why = changed[0]
        more = f" (and {', '.join(n for n, _, _ in changed[1:])})" if changed[1:] else ""
        raise InputError(f"TrainingArguments {name}={value!r}{more}: not modelled by fxmem ({why}); "
                         f"leave it at its default ({getattr(defaults, name, None)!r}) to estimate the rest")
    if args.deepspeed:
        _refuse_deepspeed(args.deepspeed, world_size)
    notes = []
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in MODELLED_OPTIMS:
        raise InputError(f"TrainingArguments optim={optim!r}: not modelled by fxmem; it models "
                         f"{', '.join(MODELLED_OPTIMS)}")
    if optim in LOW_BIT_OPTIMS:
        _check_library(optim, LOW_BIT_OPTIMS[optim])
    amp = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    if amp == "fp16" and device == "cpu":
        amp = None
        notes.append("fp16=True on the CPU: accelerate enables fp16 autocast only on other devices, so Trainer's "
                     "step runs in fp32 (estimated so)")
    checkpointing = None
    if args.activation_checkpointing:
        checkpointing = dict(args.activation_checkpointing_kwargs or {})
        if checkpointing.get("offload"):
            raise InputError("TrainingArguments activation_checkpointing_kwargs={'offload': True}: not modelled by "
                             "fxmem (the saved activations in pinned host memory)")
        checkpointing.pop("offload", None)
    strategy = Strategy(accumulate=args.gradient_accumulation_steps, compile=_compile(args),
                        **_parallelism(args, world_size, amp))
    return TrainerSettings(
        micro_batch=args.per_device_train_batch_size, accumulate=args.gradient_accumulation_steps,
        max_grad_norm=args.max_grad_norm, amp=amp, grad_scaler=amp == "fp16", checkpointing=checkpointing,
        optim=optim, use_cache=bool(args.use_cache), nan_inf_filter=bool(args.logging_nan_inf_filter),
        strategy=strategy, notes=tuple(notes))


def _compile(args: Any) -> bool | str:
    """``torch_compile``: accelerate compiles the whole model, ``torch.compile(model, backend=,
    mode=)`` (``TorchDynamoPlugin``); Inductor only (the other backends' programs are not read)."""
    if not getattr(args, "torch_compile", False):
        return False
    backend = getattr(args, "torch_compile_backend", None) or "inductor"
    if backend != "inductor":
        raise InputError(f"TrainingArguments torch_compile_backend={backend!r}: not modelled by fxmem (it models "
                         "Inductor's programs: leave the backend at 'inductor')")
    return getattr(args, "torch_compile_mode", None) or True


def _parallelism(args: Any, world_size: int, amp: str | None) -> dict[str, Any]:
    """``Strategy`` keywords for FSDP / DDP over ``world_size`` devices, from what
    ``TrainingArguments`` hands accelerate (``fsdp_plugin_args``, transformers 5.24: ``fsdp=True``
    or the legacy ``"full_shard auto_wrap"``, tuned by ``fsdp_config``)."""
    plugin = getattr(args, "fsdp_plugin_args", None) if args.fsdp else None
    if not plugin:
        return {"data_parallel": world_size} if world_size > 1 else {}
    what = f"fsdp={args.fsdp!r}, fsdp_config={args.fsdp_config!r}"
    if int(plugin.get("fsdp_version", 2)) != 2:
        raise InputError(f"TrainingArguments {what}: FSDP1 (flat parameters) is not modelled by fxmem; it models "
                         "FSDP2 (fully_shard, fsdp_config version 2, transformers' default)")
    unmodelled = {"cpu_offload": "CPU offload", "activation_checkpointing": "FSDP's own activation checkpointing",
                  "cpu_ram_efficient_loading": "loading on rank 0 only"}
    for key, why in unmodelled.items():
        if plugin.get(key):
            raise InputError(f"TrainingArguments {what}: {why} ({key}) is not modelled by fxmem")
    if str(plugin.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")) != "TRANSFORMER_BASED_WRAP" or \
            plugin.get("transformer_cls_names_to_wrap"):
        raise InputError(f"TrainingArguments {what}: fxmem models fully_shard units that are the model's blocks "
                         "(transformers' default TRANSFORMER_BASED_WRAP of its _no_split_modules); estimate another "
                         "wrapping with report(strategy=Strategy(shard_modules=...))")
    if amp is not None:
        raise InputError(f"TrainingArguments {what} with {amp}=True: FSDP's MixedPrecisionPolicy is not modelled by "
                         "fxmem")
    if world_size < 2:
        raise InputError(f"TrainingArguments {what} shards over several devices: give world_size >= 2")
    return {"data_parallel": world_size, "sharding": "zero3" if plugin.get("reshard_after_forward", True) else "zero2"}


def _refuse_deepspeed(config: Any, world_size: int | None) -> None:
    """DeepSpeed's engine is not modelled: an ``InputError`` naming its ZeRO stage (and offload)
    and the PyTorch strategy fxmem models instead."""
    stage, offload = None, False
    try:
        raw = config
        if isinstance(config, (str, os.PathLike)):
            with open(os.path.expanduser(os.fspath(config))) as f:
                raw = json.load(f)
        zero = dict(raw.get("zero_optimization") or {}) if isinstance(raw, dict) else {}
        stage = zero.get("stage")
        offload = any(str((zero.get(k) or {}).get("device", "none")) not in ("none", "None")
                      for k in ("offload_optimizer", "offload_param"))
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    what = f"ZeRO stage {stage}" + (" with offload" if offload else "") if stage is not None else "its config"
    n = world_size if world_size and world_size > 1 else "N"
    nearest = {1: "sharding='zero1'", 2: "sharding='zero2'", 3: "sharding='zero3'"}.get(stage)
    hint = (f"; the nearest PyTorch strategy fxmem models is estimator.report(model, batch, strategy=Strategy("
            f"data_parallel={n}, {nearest}), keep_output=False)" if nearest and not offload else "")
    raise InputError(f"TrainingArguments deepspeed={config!r} ({what}): DeepSpeed's engine (its flat ZeRO partitions, "
                     f"reduce and all-gather buckets, bf16 master weights{', CPU/NVMe offload' if offload else ''}) is "
                     f"not modelled by fxmem{hint}")


def _check_library(optim: str, library: str) -> None:
    """An ``InputError`` naming the package a low-bit ``optim`` needs, where it does not import."""
    import importlib

    try:
        importlib.import_module(library)
    except ImportError:
        raise InputError(f"TrainingArguments optim={optim!r} needs {library}, which does not import here "
                         f"(pip install {library})") from None


def unwrap_peft(model: nn.Module) -> nn.Module:
    """transformers' ``unwrap_peft_model``: a PEFT model's base model, else ``model``."""
    get_base = getattr(model, "get_base_model", None)
    if type(model).__module__.startswith("peft") and callable(get_base):
        return get_base()
    return model


def _trainer_loop(state: Any) -> TrainerLoop:
    """The ``TrainerLoop`` a step is handed, or a throw-away one around an optimizer or an
    ``(optimizer, lr_scheduler)`` pair (None: no optimizer step)."""
    if isinstance(state, TrainerLoop):
        return state
    if state is None or isinstance(state, torch.optim.Optimizer):
        return TrainerLoop(state)
    if isinstance(state, (tuple, list)) and len(state) == 2 and isinstance(state[0], torch.optim.Optimizer):
        return TrainerLoop(state[0], state[1])
    raise InputError("trainer_step's state must be what trainer_optimizer() builds (a TrainerLoop), an optimizer "
                     f"or (optimizer, lr_scheduler); got {type(state).__name__}")


def _parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """``Trainer.create_optimizer``'s two groups, trainable parameters only: decayed, then not."""
    decay = set(_decay_parameter_names(model))
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n in decay and p.requires_grad], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay and p.requires_grad], "weight_decay": 0.0},
    ]


def _decay_parameter_names(model: nn.Module) -> list[str]:
    """``transformers.trainer_pt_utils.get_parameter_names(model, [nn.LayerNorm], patterns)``:
    every parameter outside ``nn.LayerNorm`` modules whose lower-cased name matches none of
    ``_NO_DECAY_PATTERNS``."""
    patterns = [re.compile(p) for p in _NO_DECAY_PATTERNS]

    def names(module: nn.Module) -> list[str]:
        result = []
        for child_name, child in module.named_children():
            result += [f"{child_name}.{n}" for n in names(child)
                       if not isinstance(child, nn.LayerNorm)
                       and not any(p.search(f"{child_name}.{n}".lower()) for p in patterns)]
        result += [k for k in module._parameters if not any(p.search(k.lower()) for p in patterns)]
        return result

    return names(model)


def _accepts_loss_kwargs(model: nn.Module) -> bool:
    """``Trainer.model_accepts_loss_kwargs``: the (PEFT-unwrapped) model's ``accepts_loss_kwargs``,
    else whether its ``forward`` takes ``**kwargs``."""
    import inspect

    model = unwrap_peft(model)
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())


def _num_items_in_batch(model: nn.Module, batch_samples: list[dict[str, torch.Tensor]]) -> torch.Tensor | None:
    """``Trainer._get_num_items_in_batch`` for the micro-batches of one optimizer step on one
    process: the labels that are not -100 (``shift_labels`` if a batch has them,
    ``labels[..., 1:]`` for losses that shift the labels), summed over the micro-batches, as a
    0-dim tensor divided by the (1) devices that share the batch."""
    if not batch_samples or not isinstance(batch_samples[0].get("labels"), torch.Tensor):
        return None
    shifts = _loss_shifts_labels(model)
    labels_for_count = [b["shift_labels"] if isinstance(b.get("shift_labels"), torch.Tensor)
                        else b["labels"][..., 1:] if shifts else b["labels"] for b in batch_samples]
    num_items = sum(t.ne(_IGNORE_INDEX).sum() for t in labels_for_count)  # as Trainer: 0 + the counts
    return num_items / 1  # / (tp * cp * sp sizes)


def _loss_shifts_labels(model: nn.Module) -> bool:
    """``Trainer._loss_shifts_labels``: the (PEFT-unwrapped) model's ``loss_type`` maps to
    ``ForCausalLMLoss`` and it is not an encoder-decoder."""
    try:
        import_transformers()
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except (InputError, ImportError):
        return False
    model = unwrap_peft(model)
    config = getattr(model, "config", None)
    return (LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss
            and not getattr(config, "is_encoder_decoder", False))


def _clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """accelerate's ``Accelerator.clip_grad_norm_`` outside FSDP / DeepSpeed / XLA
    (``_clip_grad_norm_dtensor_aware``, ``norm_type=2``, ``foreach=None``): one total norm per
    device mesh (one here), the 2-norm of their ``stack``, then ``clip_grads_with_norm_`` unless
    ``max_norm`` is inf; ``torch.nn.utils.clip_grad_norm_`` without ``torch.distributed``."""
    if not torch.distributed.is_available():
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=2.0, foreach=None)
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    params = [p for p in parameters if p.grad is not None]
    norms = [get_total_norm([p.grad for p in params], 2.0, foreach=None)] if params else []
    total = torch.linalg.vector_norm(torch.stack(norms) if norms else torch.zeros(1), 2.0)
    if max_norm != float("inf") and params:
        clip_grads_with_norm_(params, max_norm, total, None)
    return total
