"""What the command line's MODEL argument names, built into ``(model, sample, loss_fn)``.

A MODEL is one of:

- a zoo name (``gpt``, ``resnet``, …; see ``models_zoo.names()``), built on the ``meta``
  device (no memory), with ``size`` one of ``models_zoo.sizes(name)``;
- ``path/to/file.py:factory`` or ``package.module:factory``, where ``factory()`` returns
  ``(model, sample)`` or ``(model, sample, loss_fn)``;
- ``transformers:NAME``, ``timm:NAME`` or ``torchvision:NAME``, built by
  ``estimator.integrations.build``.

Every problem with the spec (unknown name, missing file or attribute, a factory that raises
or returns something else) is an ``InputError`` whose message says what to write instead.
``load_function`` loads the command line's other functions of the user's (``--step``,
``--optimizer``) the same way.
Torch is imported only when a model is built, so importing this module is cheap.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any

from estimator.vocab.errors import InputError

INTEGRATIONS = ("transformers", "timm", "torchvision")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DEFAULT_ZOO_BATCH = 8
DEFAULT_ZOO_SIZE = "debug"
FORMS = (
    "a zoo name ({zoo}), path/to/file.py:factory, package.module:factory, "
    "or transformers:NAME / timm:NAME / torchvision:NAME"
)


@dataclass(frozen=True)
class Built:
    """A model ready for ``estimator.report``; ``label`` names it for status lines."""

    model: Any
    sample: Any
    loss_fn: Any
    label: str
    batch: int | None = None  # the sample's batch size when known without walking it


@dataclass(frozen=True)
class ModelArgument:
    """A parsed MODEL argument: ``kind`` is ``zoo``, ``file``, ``module`` or ``integration``."""

    kind: str
    target: str  # zoo name, file path, module name or integration source
    name: str | None = None  # factory name, or the integration's model name

    @property
    def label(self) -> str:
        if self.kind == "zoo":
            return self.target
        sep = ":" if self.name is not None else ""
        return f"{self.target}{sep}{self.name or ''}"


def zoo_names() -> list[str]:
    import models_zoo

    return models_zoo.names()


def parse(text: str) -> ModelArgument:
    """Classify a MODEL argument without building anything (zoo names need ``models_zoo``)."""
    if not isinstance(text, str) or not text.strip():
        raise InputError("MODEL is empty: " + FORMS.format(zoo=", ".join(zoo_names())))
    text = text.strip()
    if ":" not in text or _looks_like_windows_path(text):
        if text in zoo_names():
            return ModelArgument("zoo", text)
        raise InputError(_unknown_message(text))
    source, rest = text.split(":", 1)
    if source in INTEGRATIONS and rest:  # the name may hold a colon (a local config folder)
        return ModelArgument("integration", source, rest)
    target, name = text.rsplit(":", 1)  # a path may hold one (C:/models/x.py:make)
    if not target or not name:
        raise InputError(f"cannot read the model spec {text!r}: write " + FORMS.format(zoo="gpt, resnet, …"))
    return _function_argument(target, name, "factory")


def _function_argument(target: str, name: str, role: str) -> ModelArgument:
    """``target:name`` as a ``file`` or ``module`` spec (``role`` names the function in errors)."""
    if target.endswith(".py") or os.sep in target or "/" in target:
        return ModelArgument("file", target, name)
    if not all(part.isidentifier() for part in target.split(".")):
        raise InputError(
            f"{target!r} is neither a .py file nor a dotted module name: write path/to/file.py:{role} "
            f"or package.module:{role}"
        )
    return ModelArgument("module", target, name)


def load_function(text: str, what: str) -> Any:
    """The function of the user's that ``text`` names, ``path/to/file.py:NAME`` or
    ``package.module:NAME``, loaded as the MODEL argument's factory is (the command line's
    ``--step`` and ``--optimizer``); ``what`` says what it must be, for the errors
    (``"a function step(model, sample, state)"``).  The function is not called."""
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"empty function spec: write path/to/file.py:FUNCTION ({what})")
    text = text.strip()
    target, sep, name = text.rpartition(":")
    if not sep or not target or _looks_like_windows_path(text):
        raise InputError(f"name the function in {text!r}: write {text}:FUNCTION ({what})")
    if not name.isidentifier():
        raise InputError(f"{name!r} in {text!r} is not a function name: write path/to/file.py:FUNCTION ({what})")
    return _function(_function_argument(target, name, "FUNCTION"), what)


def _looks_like_windows_path(text: str) -> bool:
    return len(text) > 2 and text[1] == ":" and text[0].isalpha() and text[2] in "\\/" and text.count(":") == 1


def _unknown_message(text: str) -> str:
    names = zoo_names()
    if text.endswith(".py"):
        return f"name the factory function in {text!r}: write {text}:FUNCTION (FUNCTION() returns (model, sample))"
    close = difflib.get_close_matches(text, names, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"unknown model {text!r}.{hint} MODEL is " + FORMS.format(zoo=", ".join(names))


def resolve(
    text: str,
    *,
    size: str | None = None,
    batch: int | None = None,
    dtype: str | None = None,
    device_init: str = "meta",
    seq_len: int | None = None,
    quantize: str | None = None,
    lora: int | None = None,
) -> Built:
    """Build the MODEL argument ``text``.

    ``size`` applies to zoo models only (default ``debug``); ``batch`` is the sample's batch
    size for zoo and integration models (a factory's sample keeps its own); ``dtype``
    (``fp32``/``bf16``/``fp16``) casts the parameters and the sample's floating tensors;
    ``device_init`` is where zoo and integration models are built (``meta``: no memory);
    ``seq_len`` the tokens per sample of a transformers model, ``quantize`` its bitsandbytes
    quantization mode (``estimator.integrations.bitsandbytes.config``); ``lora`` the rank of
    PEFT LoRA adapters trained instead of the model (``_with_lora``).
    """
    spec = parse(text)
    transformers = spec.kind == "integration" and spec.target == "transformers"
    if seq_len is not None and not transformers:
        raise InputError(f"--seq-len applies to transformers models only, not to {spec.label!r}")
    if quantize is not None and not transformers:
        raise InputError(f"--quantize applies to transformers models only, not to {spec.label!r}")
    if size is not None and spec.kind != "zoo":
        raise InputError(f"--size applies to zoo models only, not to {spec.label!r}")
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if spec.kind == "zoo":
        built = _zoo(spec.target, size or DEFAULT_ZOO_SIZE, batch, dtype, device_init)
    elif spec.kind == "integration":
        built = _cast(_integration(spec, batch, dtype, device_init, seq_len, quantize), dtype, model_too=False)
    else:
        built = _cast(_factory(spec), dtype)
    return built if lora is None else dataclasses.replace(built, model=_with_lora(built.model, lora))


def _with_lora(model, rank: int):
    """``model`` wrapped by PEFT with LoRA adapters of rank ``rank`` (``LoraConfig(r=rank)``: PEFT's
    default target modules for a transformers model type it knows, else ``"all-linear"``)."""
    try:
        import peft
    except ImportError as exc:
        raise InputError(f"--lora needs PEFT ({exc}): pip install peft") from exc
    try:
        return peft.get_peft_model(model, peft.LoraConfig(r=rank))
    except ValueError:  # "Please specify `target_modules`": not a model type PEFT knows
        try:
            return peft.get_peft_model(model, peft.LoraConfig(r=rank, target_modules="all-linear"))
        except ValueError as exc:
            raise InputError(f"--lora: PEFT cannot add LoRA adapters to this model: {exc}") from exc


def _torch_dtype(dtype: str | None):
    import torch

    return None if dtype is None else getattr(torch, DTYPES[dtype])


def _zoo(name: str, size: str, batch: int | None, dtype: str | None, device_init: str) -> Built:
    import models_zoo

    cast = dtype not in (None, "fp32")  # zoo models and samples are float32
    try:
        model, make_sample, loss_fn = models_zoo.get(
            name, size, device=device_init, dtype=_torch_dtype(dtype) if cast else None
        )
    except ValueError as exc:  # unknown size: its message lists the valid ones
        raise InputError(str(exc)) from None
    batch = batch or DEFAULT_ZOO_BATCH
    built = Built(model, make_sample(batch), loss_fn, f"{name} ({size})", batch)
    return _cast(built, dtype, model_too=False) if cast else built


def _integration(spec: ModelArgument, batch: int | None, dtype: str | None, device_init: str,
                 seq_len: int | None = None, quantize: str | None = None) -> Built:
    try:
        from estimator.integrations import build
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("estimator.integrations"):
            raise InputError(f"{spec.label}: this fxmem has no estimator.integrations module") from None
        raise
    batch = batch or 2
    options = {} if seq_len is None else {"seq_len": seq_len}
    if quantize is not None:
        from estimator.integrations import bitsandbytes

        options["quantization"] = bitsandbytes.config(quantize, _torch_dtype(dtype))
    model, sample, loss_fn = build(spec.target, spec.name, batch=batch, device=device_init, dtype=_torch_dtype(dtype),
                                   **options)
    return Built(model, sample, loss_fn, spec.label, batch)


def _function(spec: ModelArgument, what: str) -> Any:
    """The callable ``spec`` names in its file or module (imported here); ``what`` describes it."""
    module = _import_file(spec.target) if spec.kind == "file" else _import_module(spec.target)
    function = getattr(module, spec.name, None)
    if function is None:
        public = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        close = difflib.get_close_matches(spec.name, public, n=1)
        hint = f" Did you mean {spec.target}:{close[0]}?" if close else ""
        raise InputError(f"{spec.target} has no {spec.name!r}.{hint}")
    if not callable(function):
        raise InputError(f"{spec.label} is a {type(function).__name__}, not {what}")
    return function


def _factory(spec: ModelArgument) -> Built:
    where = spec.label
    factory = _function(spec, "a function returning (model, sample)")
    try:
        result = factory()
    except (KeyboardInterrupt, InputError):
        raise
    except Exception as exc:
        raise InputError(f"{where}() raised {type(exc).__name__}: {exc}") from exc
    return _check_factory_result(result, where)


def _check_factory_result(result: Any, where: str) -> Built:
    from torch import nn

    shape = "(model, sample) or (model, sample, loss_fn)"
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        got = f"{len(result)} values" if isinstance(result, (tuple, list)) else f"a value of type {type(result).__name__}"
        raise InputError(f"{where}() must return {shape}, got {got}")
    model, sample, loss_fn = (*result, None) if len(result) == 2 else result
    if not isinstance(model, nn.Module):
        raise InputError(f"{where}() must return {shape}: the model is a {type(model).__name__}, not a torch.nn.Module")
    if loss_fn is not None and not callable(loss_fn):
        raise InputError(f"{where}() must return {shape}: loss_fn is a {type(loss_fn).__name__}, not callable")
    return Built(model, sample, loss_fn, where)


def _import_file(path: str):
    if not os.path.isfile(path):
        raise InputError(f"no such file: {path!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:  # so that the file can import its neighbours
        sys.path.insert(0, folder)
    name = "_fxmem_user_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_").replace(".", "_")
    # one file named twice (`model.py:make --step model.py:train_step`) is imported once: one
    # module, its classes and module-level code shared, as a Python import would
    stamp = (os.path.abspath(path), os.stat(path).st_mtime_ns)
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__fxmem_source__", None) == stamp:
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise InputError(f"cannot load {path!r} as Python source")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    write_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ beside their file
    try:
        spec.loader.exec_module(module)
    except (KeyboardInterrupt, InputError):
        sys.modules.pop(name, None)  # no half-run module left to reuse
        raise
    except Exception as exc:
        sys.modules.pop(name, None)
        raise InputError(f"importing {path} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.dont_write_bytecode = write_bytecode
    module.__fxmem_source__ = stamp
    return module


def _import_module(name: str):
    if "" not in sys.path and os.getcwd() not in sys.path:  # as `python -m` does
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):
            raise InputError(f"cannot import module {name!r}: no module named {exc.name!r}") from exc
        raise InputError(f"importing {name} failed: {type(exc).__name__}: {exc}") from exc
    except (KeyboardInterrupt, InputError):
        raise
    except Exception as exc:
        raise InputError(f"importing {name} failed: {type(exc).__name__}: {exc}") from exc


def _cast(built: Built, dtype: str | None, model_too: bool = True) -> Built:
    import torch
    from torch.utils._pytree import tree_map_only

    target = _torch_dtype(dtype)
    if target is None:
        return built
    model = built.model.to(dtype=target) if model_too else built.model
    sample = tree_map_only(torch.Tensor, lambda t: t.to(target) if t.is_floating_point() else t, built.sample)
    return Built(model, sample, built.loss_fn, built.label, built.batch)
