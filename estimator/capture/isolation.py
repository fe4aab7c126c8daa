"""The user's process untouched, and torch quiet, while fxmem runs the step on fake tensors.

The process's global module hooks are taken out for the capture (``global_hooks_suspended``: they
would be handed fake tensors), ``module.to(dtype)`` converts fake parameters as it converts real
ones (``conversions_as_for_real``), torch's log records and warnings are kept from the user
(``quiet``: the user's own warnings are issued again), bitsandbytes' process-wide optimizer
overrides are put back as they were (``optimizer_overrides_kept``), and an exception from deep
inside torch leaves as an fxmem error that names the op or the user's line (``errors_named``,
``user_frame``).
Each is undone on exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
import warnings

import torch
from torch import nn

from estimator.corrections import custom_ops
from estimator.corrections.patches import patched
from estimator.vocab.errors import CaptureError, FxmemError, SymbolicCaptureFailed

_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks", "_global_forward_hooks_always_called",
                 "_global_forward_hooks_with_kwargs")


@contextlib.contextmanager
def global_hooks_suspended():
    """Take the process's global module hooks (``register_module_forward_hook`` and the like)
    out while fxmem runs the step: they would be handed fake tensors.  Yields how many there
    were; they are back in place, in order, on exit."""
    module = nn.modules.module
    saved = {name: dict(getattr(module, name)) for name in _GLOBAL_HOOKS if hasattr(module, name)}
    for name in saved:
        getattr(module, name).clear()
    hooks = sum(len(saved.get(name, {})) for name in _GLOBAL_HOOKS[:4])
    try:
        yield hooks
    finally:
        for name, entries in saved.items():
            table = getattr(module, name)
            added = dict(table)  # registered meanwhile and not removed (not fxmem's: it removes its own)
            table.clear()
            table.update(entries)
            table.update(added)


@contextlib.contextmanager
def optimizer_overrides_kept():
    """bitsandbytes' ``GlobalOptimManager`` is one per process, and transformers' ``Trainer``
    registers an override in it for each ``nn.Embedding`` when it builds an 8-bit Adam
    (``register_module_override(module, "weight", {"optim_bits": 32})``, trainer.py
    ``create_optimizer``); the next optimizer's ``check_overrides`` files it by (group, index)
    position as well, which every later 8-bit optimizer of the process reads (found in the test
    suite: after a real Trainer, another model's parameter at such a position kept fp32 state).
    A capture that builds one for the fake model (``integrations.trainer``, as Trainer does)
    would leave the user's next optimizers 32-bit at those positions: the manager's state is put
    back on exit (emptied where bitsandbytes was not loaded before)."""
    module = sys.modules.get("bitsandbytes.optim.optimizer")
    saved = None
    if module is not None:  # its tables copied (a capture adds to them in place), the rest as it is
        saved = {name: value.copy() if isinstance(value, (dict, list)) else value
                 for name, value in vars(module.GlobalOptimManager.get_instance()).items()}
    try:
        yield
    finally:
        module = sys.modules.get("bitsandbytes.optim.optimizer")
        if module is not None:
            manager = module.GlobalOptimManager.get_instance()
            manager.initialize()
            if saved is not None:
                vars(manager).update(saved)


@contextlib.contextmanager
def conversions_as_for_real():
    """``module.to(dtype)`` / ``.float()`` / ``.type()`` during the step, as for real tensors.

    ``nn.Module._apply`` converts a FakeTensor parameter with ``torch.utils.swap_tensors``
    (torch/nn/modules/module.py: ``isinstance(param, FakeTensor)``) where a real one is converted
    with ``param.data = param_applied``; the swap refuses tensors that have weak references, as
    the capture's fake parameters do ("Couldn't swap Linear.weight").  While the step runs, a
    swap of a tensor with itself (a conversion that changes nothing) is the no-op it is for real
    tensors, and a refused swap sets ``.data``, as for real tensors: the old storage goes when
    nothing else holds it, the new one is the conversion's copy (priced where it was made)."""
    swap = torch.utils.swap_tensors

    def as_for_real(t1, t2):
        if t1 is t2:
            return
        try:
            swap(t1, t2)
        except RuntimeError:
            t1.data = t2

    with patched(torch.utils, "swap_tensors", as_for_real):
        yield


@contextlib.contextmanager
def quiet():
    """Torch's log records and warnings are not the user's business while fxmem runs the step
    on fake tensors (a shape error logs a traceback at ERROR before fxmem's one-line error):
    torch's loggers are disabled and warnings recorded for the block, both restored on exit.
    Warnings raised from the user's own files are issued again afterwards, once each; what
    matters of the others is in fxmem's errors and notes."""
    loggers = [logging.getLogger("torch")] + [
        logger for name, logger in list(logging.root.manager.loggerDict.items())
        if name.startswith("torch.") and isinstance(logger, logging.Logger)
    ]
    disabled = [(logger, logger.disabled) for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        for logger, was in disabled:
            logger.disabled = was
    seen = set()
    for w in caught:
        key = (str(w.message), w.category, w.filename, w.lineno)
        if not w.filename.startswith(_INTERNAL) and key not in seen:
            seen.add(key)
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


_INTERNAL = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))


@contextlib.contextmanager
def errors_named(symbolic: bool):
    """Turn an exception from deep inside torch into one that names the op or line."""
    try:
        yield
    except FxmemError:
        raise
    except Exception as exc:  # re-raised with a clear message
        where = user_frame(exc)
        undeclared = custom_ops.undeclared_op(exc, where)  # an op without a fake kernel: how to declare it
        if undeclared is not None:
            raise undeclared from exc
        message = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        if where:
            message += f" (at {where})"
        if "got mixed torch.Tensor and DTensor" in str(exc):
            message += _MIXED_DTENSORS
        cls = SymbolicCaptureFailed if symbolic else CaptureError
        raise cls(f"the model could not be run on fake tensors: {message}") from exc


# torch.optim's foreach path (the CUDA default) takes DTensors (torch/distributed/tensor/__init__.py appends
# DTensor to optimizer._foreach_supported_types) and groups parameters by device and dtype only
# (Optimizer._group_tensors_by_device_and_dtype): a DTensor and a plain parameter land in one foreach call
_MIXED_DTENSORS = (". A real run fails the same way: the optimizer's foreach path (CUDA's default) puts DTensor and "
                   "plain parameters of one dtype in one call; distribute every parameter in your parallelize "
                   "function (norms too: SequenceParallel, or replicate them) or pass foreach=False")


def user_frame(exc: BaseException) -> str | None:
    """The innermost frame of the traceback outside torch and fxmem: the user's line."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if not frame.filename.startswith(_INTERNAL):
            return f"{frame.filename}:{frame.lineno} in {frame.name}: {frame.line}"
    return None
