"""Hugging Face ``TrainingArguments`` -> the report of the optimizer step ``transformers.Trainer`` runs.

All at once, from the arguments you give ``Trainer`` (a ``TrainingArguments``, a dict or a JSON
file)::

    rep = from_training_args(model, args, device="cuda")   # b = per-device batch x accumulation steps

``training_settings`` (``estimator.integrations.trainer``) reads the arguments;
``from_training_args`` does what Trainer does to the model to a copy sharing its parameters
(``config.use_cache``, activation checkpointing), builds the sample a data collator would when
none is given (``transformers:NAME``'s), and reports ``trainer_step`` / ``trainer_optimizer``
with those settings, noting the micro-batch accelerate's dataloader holds ahead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from estimator.integrations.trainer import (
    TrainerSettings,
    device_type_of,
    import_transformers,
    split_micro_batches,
    trainer_optimizer,
    trainer_step,
    training_arguments,
    training_settings,
    unwrap_peft,
)
from estimator.integrations.transformers import make_sample
from estimator.vocab.errors import InputError


def from_training_args(model: nn.Module, args: Any, sample: Any = None, *, world_size: int = 1, **report_kwargs):
    """``estimator.report`` of the optimizer step ``transformers.Trainer`` runs with ``args`` (a
    ``TrainingArguments``, a dict of its fields or the path of a JSON file of them) on ``model``:
    ``trainer_step`` / ``trainer_optimizer`` with the settings ``training_settings`` reads.

    ``b`` is the batch of one optimizer step on one device: ``per_device_train_batch_size`` ×
    ``gradient_accumulation_steps`` (``report_kwargs["batch"]`` evaluates another; it must be a
    multiple of the accumulation steps).  ``sample``: one batch as the data collator makes it (a
    dict of tensors, ``labels`` included; any number of rows: the formulas are in ``b``; a tensor
    under two keys, ``labels`` given as the ``input_ids`` tensor itself, is copied: a collator
    stacks each key apart); default: the sample ``transformers:NAME`` models get
    (``per_device_train_batch_size`` rows, a copy of the token ids as labels).

    The model is not modified: a copy sharing its parameters gets what Trainer does to it
    (``config.use_cache = args.use_cache``; with ``activation_checkpointing``,
    ``activation_checkpointing_enable(...)`` with the arguments' keywords, as
    ``Trainer.train`` calls it).  ``report_kwargs`` go to ``estimator.report`` (``device``,
    ``gpu``, ``batch``, ``dynamic``, ...); ``step``, ``optimizer``, ``strategy``, ``amp``,
    ``grad_scaler``, ``loss_fn``, ``keep_output`` and ``mode`` come from ``args`` and are refused.
    ``world_size``: the devices of the run (``fsdp``, DDP); Trainer's step on several devices is
    not modelled yet: the ``InputError`` names the ``Strategy`` fxmem models instead.
    """
    import inspect

    import estimator

    taken = sorted(set(report_kwargs) & {"step", "optimizer", "strategy", "amp", "grad_scaler", "loss_fn",
                                           "keep_output", "mode"})
    if taken:
        raise InputError(f"from_training_args takes {', '.join(taken)} from the TrainingArguments: drop "
                         f"{' and '.join(taken)}")
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    device = report_kwargs.setdefault("device", inspect.signature(estimator.report).parameters["device"].default)
    settings = training_settings(args, device=device_type_of(device), world_size=world_size)
    if settings.strategy.distributed:
        raise InputError(f"Trainer's step on {settings.strategy.devices} devices is not modelled by fxmem yet (its "
                         "multi-device strategies transform the built-in step); the nearest estimate is "
                         f"estimator.report(model, batch, strategy={_strategy_call(settings.strategy)}, "
                         "keep_output=False)")
    args = training_arguments(args)
    trained = _as_trainer_prepares(model, settings)
    sample = _trainer_sample(trained, settings.micro_batch) if sample is None else _collated(sample)
    if report_kwargs.get("batch") is None:
        report_kwargs["batch"] = settings.batch
    step_fn = trainer_step(settings.max_grad_norm, accumulate=settings.accumulate, amp=settings.amp,
                           device=device_type_of(device), nan_inf_filter=settings.nan_inf_filter)
    on_cpu = device_type_of(device) == "cpu"
    rep = estimator.report(
        trained, sample,
        step=_with_next_micro_batch(step_fn, settings.accumulate) if on_cpu else step_fn,
        optimizer=trainer_optimizer(args=args, device=device_type_of(device)),
        strategy=settings.strategy if settings.accumulate > 1 else None,
        **report_kwargs)
    tensors = [t for t in tree_flatten(sample)[0] if isinstance(t, torch.Tensor)]
    rows = max((t.shape[0] for t in tensors), default=1)
    ahead = sum(t.untyped_storage().nbytes() for t in tensors) * (rep.batch // settings.accumulate) // rows
    where = ("counted: on the CPU it shares the allocator (a copy of one micro-batch made as the step starts and "
             "alive to its end: among the activations)" if on_cpu else "host memory, not the GPU's")
    loader = (f"accelerate's DataLoaderShard fetches the next micro-batch while the step runs ({ahead:,} B at "
              f"b = {rep.batch}): {where}")
    return dataclasses.replace(rep, notes=(*rep.notes, *settings.notes, loader))


def _with_next_micro_batch(step_fn, k: int):
    """``step_fn`` with the micro-batch accelerate's ``DataLoaderShard`` holds ahead alive through
    the whole step (it fetches the next batch before it yields the current one): a copy of one of
    the step's ``k`` micro-batches, made first and dropped last."""

    def step(model: nn.Module, batch: dict[str, torch.Tensor], state: Any) -> None:
        ahead = {key: t.clone() if isinstance(t, torch.Tensor) else t
                 for key, t in split_micro_batches(batch, k)[0].items()}
        step_fn(model, batch, state)
        del ahead

    return step


def _strategy_call(strategy: Any) -> str:
    """``Strategy(accumulate=2, data_parallel=4)``: the fields that are not the default."""
    from estimator.vocab.strategy import DEFAULT

    fields = [f"{f.name}={getattr(getattr(strategy, f.name), 'value', getattr(strategy, f.name))!r}"
              for f in dataclasses.fields(strategy) if getattr(strategy, f.name) != getattr(DEFAULT, f.name)]
    return f"Strategy({', '.join(fields)})"


def _as_trainer_prepares(model: nn.Module, settings: TrainerSettings) -> nn.Module:
    """A copy of ``model`` (its parameters and buffers shared, not copied) with what
    ``Trainer.__init__`` / ``train`` do to the model: ``config.use_cache = args.use_cache``, and
    ``activation_checkpointing_enable`` with the arguments' keywords."""
    import copy

    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    trained = copy.deepcopy(model, memo=shared)
    config = getattr(trained, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = settings.use_cache
    if settings.checkpointing is not None:
        kwargs = dict(settings.checkpointing)
        every_n_layers = kwargs.pop("every_n_layers", 1)
        enable = getattr(trained, "activation_checkpointing_enable", None)
        if enable is None:
            raise InputError(f"activation_checkpointing=True: {type(model).__name__} has no "
                             "activation_checkpointing_enable (a transformers PreTrainedModel or PEFT model has)")
        try:
            enable(activation_checkpointing_kwargs=kwargs or None, every_n_layers=every_n_layers)
        except (ValueError, TypeError) as exc:
            raise InputError(f"activation_checkpointing=True: {type(model).__name__}: {exc}") from exc
    return trained


def _collated(sample: Any) -> Any:
    """``sample`` with each key its own tensor, as a data collator stacks them (``labels`` the very
    tensor ``input_ids`` is, as ``transformers:NAME`` samples and training scripts pass it: a
    copy)."""
    if not isinstance(sample, dict):
        return sample
    seen: set[int] = set()
    out = {}
    for key, t in sample.items():
        if isinstance(t, torch.Tensor):
            t = t.clone() if id(t) in seen else t
            seen.add(id(t))
        out[key] = t
    return out


def _trainer_sample(model: nn.Module, rows: int) -> dict[str, torch.Tensor]:
    """``transformers:NAME``'s sample for ``model`` with ``rows`` rows, each key its own tensor
    (a collator stacks ``labels`` apart from ``input_ids``)."""
    transformers = import_transformers()
    base = unwrap_peft(model)
    config = getattr(base, "config", None)
    if config is None:
        raise InputError(f"{type(model).__name__} has no config: pass from_training_args a sample (a dict of tensors "
                         "as the data collator makes it)")
    return _collated(make_sample(transformers, base, config, rows, None, None))
