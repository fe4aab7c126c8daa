"""Models that fxmem is validated on, written from code (no downloads).

    model, make_sample, loss_fn = models_zoo.get("gpt", "debug")
    sample = make_sample(8)        # CPU tensors, dim 0 = batch, same values every call
    out = model(**sample)          # tensor: model(x); tuple: model(*x); dict: model(**x)
    loss = loss_fn(out, sample)    # scalar

Models (sizes; every model has a tiny "debug"):
    mlp               MLP classifier, GELU/ReLU + dropout              (debug, small)
    resnet            ResNet with BatchNorm, basic/bottleneck blocks   (debug, resnet18, resnet50)
    unet              conv U-Net, GroupNorm/BatchNorm, skip concat     (debug, small)
    vit               Vision Transformer on nn.MultiheadAttention      (debug, vit-b16)
    gpt               GPT-2, causal SDPA, tied lm_head                 (debug, gpt2-small)
    bert              BERT encoder, padding mask, manual softmax attn  (debug, base)
    rnn               LSTM x2 + GRU language model                     (debug, small)
    lstm_lm           LSTM LM, the head on the non-contiguous LSTM output (debug, small)
    lora              transformer LM, frozen base + LoRA adapters      (debug, small)
    tied_autoencoder  decoder reuses encoder weights; a shared Linear  (debug, small)
    llama             Llama-2: RMSNorm, RoPE, GQA, SwiGLU              (debug, 7b)
    convnets          one small net per conv family, conv/BN pricing   (debug, depthwise, grouped,
                      dilated, conv1d, conv3d, transposed, patch, stem, small-channels, bn-eval)
    custom_op         a torch.library.custom_op with a workspace, its  (debug, small)
                      memory declared with estimator.register_op
    moe               MoE LM: top-2 routing, a loop over the experts   (debug, small)
                      (torch.where on the one-hot mask: data-dependent)
    mixtral           transformers' Mixtral from a config (grouped_mm) (debug, 8x7b)
    masked_lm         MLM whose head runs on hidden[labels != -100]    (debug, base)
    spec_augment      speech encoder, random time masks x[mask] = e    (debug, base)
    mha_padding       nn.MultiheadAttention + key_padding_mask: the    (debug, base)
                      native fast path in eval
    encoder_padding   nn.TransformerEncoder + src_key_padding_mask:    (debug, base)
                      nested tensors in eval (data-dependent tokens)

Each model module exposes Config (a frozen dataclass), SIZES, its nn.Module
and make(cfg) -> (model, make_sample, loss_fn), so custom configs work too:
    models_zoo.gpt.make(dataclasses.replace(models_zoo.gpt.SIZES["debug"], n_layer=4))
"""

import difflib
import importlib
from types import ModuleType

import torch

__all__ = ["data_dependent", "get", "names", "sizes"]

# Name -> the submodule that builds it, imported on first use (``_module``): importing every model
# (transformers' Mixtral, a custom op's registration) would cost a command line that builds one
# model a second or more.
_NAMES = ("mlp", "resnet", "unet", "vit", "gpt", "bert", "rnn", "lstm_lm", "lora", "tied_autoencoder", "llama",
          "convnets", "custom_op", "moe", "mixtral", "masked_lm", "spec_augment", "mha_padding", "encoder_padding")


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"models_zoo.{name}")


def __getattr__(attr: str) -> ModuleType:  # models_zoo.gpt.make(...) works without importing models_zoo.gpt first
    if attr in _NAMES:
        return _module(attr)
    raise AttributeError(f"module 'models_zoo' has no attribute {attr!r}")


def _unknown(what: str, valid: list[str], value) -> ValueError:
    close = difflib.get_close_matches(str(value), valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(f"unknown {what}.{hint} Valid: {', '.join(valid)}")


def names() -> list[str]:
    """Model names, in registry order."""
    return list(_NAMES)


def sizes(name: str) -> list[str]:
    """Size names for one model; "debug" is always first."""
    if name not in _NAMES:
        raise _unknown(f"model {name!r}", names(), name)
    return list(_module(name).SIZES)


def data_dependent(name: str) -> str | None:
    """How fxmem's validation prices the model's data-dependent sizes (None: it has none)."""
    sizes(name)
    return getattr(_module(name), "DATA_DEPENDENT", None)


def library(name: str) -> str | None:
    """The package whose code builds the model (its numbers follow that package's version: a
    model's forward can change between releases), or None for the zoo's own code."""
    sizes(name)
    return getattr(_module(name), "LIBRARY", None)


def get(name: str, size: str = "debug", device=None, dtype: torch.dtype | None = None):
    """Build a zoo model in train mode. Returns (model, make_sample, loss_fn).

    device: where parameters are created; "meta" allocates nothing, so even
    llama 7b builds in well under a second. dtype: cast floating parameters and
    buffers (e.g. torch.bfloat16); make_sample still returns float32 inputs.
    """
    valid_sizes = sizes(name)
    if size not in valid_sizes:
        raise _unknown(f"size {size!r} for model {name!r}", valid_sizes, size)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    module = _module(name)
    cfg = module.SIZES[size]
    if device is None:
        model, make_sample, loss_fn = module.make(cfg)
    else:
        # factory functions inside the constructors allocate directly on `device`
        with torch.device(device):
            model, make_sample, loss_fn = module.make(cfg)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model, make_sample, loss_fn
