"""bitsandbytes weights as the device holds them, made on the meta device: quantized without values.

bitsandbytes quantizes a weight when it moves to its device: ``Params4bit.to`` and
``Int8Params.to`` call ``_quantize`` for any device but meta (bitsandbytes/nn/modules.py).  A
model built on the meta device holds unquantized shells, which no real run ever executes;
``quantize`` runs bitsandbytes' own ``_quantize`` on the meta device (``functional.quantize_4bit``
/ ``int8_vectorwise_quant`` on meta tensors, their sizes from the ops' registered fake kernels,
bitsandbytes/_ops.py): per tensor what a quantized weight holds.

- 4-bit (``Params4bit``): the packed codes, ``ceil(n / 2)`` bytes (``quant_storage`` uint8), one
  fp32 absmax per ``blocksize`` elements (64 by default) and the 16-entry fp32 code; with
  ``compress_statistics`` (double quantization) the absmax are uint8, plus one fp32 absmax per
  256 of them, the 256-entry fp32 dynamic code and the fp32 offset;
- 8-bit (``Int8Params``): int8 codes of the weight's shape and one fp32 scale per row.

``nf4_linears`` replaces a model's linear layers by NF4 ``Linear4bit`` s so (a what-if of
``compare``: QLoRA's base weights).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from estimator.vocab.errors import InputError


def unquantized(weight: Any) -> bool:
    """Whether ``weight`` is a bitsandbytes weight not quantized yet: a ``Params4bit`` or an
    ``Int8Params`` (without fp16 weights) that has not moved to a device, where bitsandbytes
    quantizes it (``.to``: ``_quantize``, bitsandbytes/nn/modules.py).  A model holding one has
    imported bitsandbytes."""
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return False
    if isinstance(weight, bnb.nn.Params4bit):  # (Lightning 2.1 quantizes without setting the flag)
        return not weight.bnb_quantized and weight.quant_state is None
    if isinstance(weight, bnb.nn.Int8Params):
        return not weight.has_fp16_weights and weight.dtype != torch.int8
    return False


def quantize(model: nn.Module) -> nn.Module:
    """Quantize, in place, every bitsandbytes weight of ``model`` not quantized yet, as moving it to
    its device does (``Params4bit._quantize`` / ``Int8Params._quantize``), on the device it is on:
    on the meta device the quantized weights are sized from the ops' fake kernels, no values needed.
    Returns ``model``."""
    if "bitsandbytes" not in sys.modules:  # a model holding bitsandbytes weights has imported it
        return model
    dynamic_map_on_cpu()
    for module in model.modules():
        weight = module._parameters.get("weight")
        if unquantized(weight):
            module.weight = weight._quantize(weight.device)
    return model


def nf4_linears(model: nn.Module, keep: tuple[nn.Module, ...] = ()) -> nn.Module:
    """Every ``nn.Linear`` of ``model`` but ``keep`` (the output head) and those whose weight is tied to
    another module's (as transformers keeps tied weights unquantized), in place, as bitsandbytes'
    ``Linear4bit`` with the QLoRA paper's storage (NF4, double quantization, bf16 compute): what
    ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
    bnb_4bit_compute_dtype=torch.bfloat16)`` loads (transformers' ``replace_with_bnb_linear``), each
    weight quantized from its own dtype on its device (``quantize``).  Returns ``model``."""
    try:
        import bitsandbytes as bnb
    except ImportError as exc:
        raise InputError(f"4-bit weights need bitsandbytes ({exc}): pip install bitsandbytes") from exc
    kept = {id(m) for m in keep}
    uses: dict[int, int] = {}  # a weight tied to another module's (an LM head's to the embedding) stays
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or id(child) in kept or uses[id(child.weight)] > 1:
                continue
            layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                                      device=child.weight.device)
            layer.weight = bnb.nn.Params4bit(child.weight.detach(), requires_grad=False, compress_statistics=True,
                                             quant_type="nf4", module=layer)
            if child.bias is not None:
                layer.bias = child.bias
            setattr(parent, name, layer)
    return quantize(model)


def dynamic_map_on_cpu() -> None:
    """Fill bitsandbytes' process-wide cache of the 8-bit dynamic code (``functional.name2qmap
    ["dynamic"]``, which double quantization uses) on the CPU: ``quantize_blockwise`` creates it on
    the device of its first input, and a meta one would break every later real quantization
    ("Cannot copy out of meta tensor").  The values are bitsandbytes' own ``create_dynamic_map()``."""
    functional = sys.modules["bitsandbytes"].functional
    if "dynamic" not in functional.name2qmap:
        functional.name2qmap["dynamic"] = functional.create_dynamic_map()
