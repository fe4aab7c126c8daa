"""bitsandbytes' quantized weights without the weights, for users and for transformers models.

``quantize(model)`` (``estimator.capture.quantized``): every bitsandbytes weight of a model not
quantized yet (the meta shells a model built on the meta device holds) quantized by
bitsandbytes' own ``_quantize`` on the meta device, sized by its ops' fake kernels.

``quantize_transformers`` is ``from_pretrained``'s quantization for a model built from its config:
transformers' own quantizer (``get_hf_quantizer``, ``preprocess_model``: ``replace_with_bnb_linear``
with the modules it keeps unquantized, ``postprocess_model``) and, per weight, what its load
operation does (transformers/integrations/bitsandbytes.py ``Bnb4bitQuantize`` / ``Bnb8bitQuantize``:
``Params4bit(value, requires_grad=False, **shell.__dict__).to(value.device)``, a GPT-2 ``Conv1D``
weight transposed first), with the model's own tensors as the values (meta, or real for measuring).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from estimator.capture.quantized import dynamic_map_on_cpu, quantize
from estimator.integrations._common import import_optional
from estimator.vocab.errors import InputError

__all__ = ["config", "quantize", "quantize_transformers"]

META = torch.device("meta")


def quantize_transformers(transformers, model: nn.Module, config, quantization: Any) -> nn.Module:
    """``model`` (built from ``config`` by ``_from_config``) quantized as ``from_pretrained(...,
    quantization_config=quantization)`` loads it: ``quantization`` (a ``BitsAndBytesConfig`` or its
    dict) or, when None, the config's own ``quantization_config`` (a pre-quantized Hub model)."""
    from transformers.quantizers.auto import get_hf_quantizer

    if quantization is None and getattr(config, "quantization_config", None) is None:
        return model
    _check_method(quantization if quantization is not None else config.quantization_config)
    bnb = _bnb()
    device = next((p.device for p in model.parameters()), META)
    try:
        quantizer, config, _ = get_hf_quantizer(config, quantization, {"": str(device)}, True, {})
    except (ImportError, ValueError, RuntimeError) as exc:
        raise InputError(f"transformers refuses this quantization: {exc}") from exc
    values = dict(model.named_parameters())  # what the checkpoint would hold, by name
    dynamic_map_on_cpu()
    quantizer.preprocess_model(model=model, dtype=model.dtype, device_map={"": str(device)})
    conv1d = transformers.pytorch_utils.Conv1D
    for name, module in model.named_modules():
        shell = module._parameters.get("weight")
        if not isinstance(shell, (bnb.nn.Params4bit, bnb.nn.Int8Params)):
            continue
        value = values[f"{name}.weight"].detach()
        if issubclass(getattr(module, "source_cls", nn.Linear), conv1d):
            value = value.T
        kwargs = dict(shell.__dict__)
        if isinstance(shell, bnb.nn.Params4bit):
            kind = bnb.nn.Params4bit
        else:
            kind = bnb.nn.Int8Params
            kwargs.pop("SCB", None)
        module.weight = kind(value, requires_grad=False, **kwargs)._quantize(value.device)
        module._is_hf_initialized = True
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)
    return model


def config(mode: str, compute_dtype: torch.dtype | None = None):
    """The ``BitsAndBytesConfig`` of a quantization mode by the names Lightning's
    ``BitsandbytesPrecision`` gives them: ``nf4``, ``nf4-dq`` (double quantization), ``fp4``,
    ``fp4-dq`` (4-bit, compute dtype ``compute_dtype``, else bf16), ``int8`` (``load_in_8bit``)."""
    import transformers

    if mode == "int8":
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    kind, _, double = mode.partition("-")
    if kind not in ("nf4", "fp4") or double not in ("", "dq"):
        raise InputError(f"unknown quantization mode {mode!r}: nf4, nf4-dq, fp4, fp4-dq or int8")
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind,
                                           bnb_4bit_use_double_quant=bool(double),
                                           bnb_4bit_compute_dtype=compute_dtype or torch.bfloat16)


def _check_method(quantization: Any) -> None:
    method = quantization.get("quant_method") if isinstance(quantization, dict) else \
        getattr(quantization, "quant_method", None)
    method = getattr(method, "value", method)
    if method != "bitsandbytes":
        raise InputError(f"the model is quantized with {method!r}, which fxmem does not model (bitsandbytes' "
                         "4-bit and 8-bit weights only); build it unquantized with quantization=False to estimate "
                         "the model in its unquantized dtype")


def _bnb():
    return import_optional("bitsandbytes", "lowbit")
