"""Hugging Face transformers models, built from a config (random weights), never downloaded.

``name`` is one of:

- a ``model_type`` (a key of ``transformers.CONFIG_MAPPING``): ``gpt2``, ``llama``, ``bert``,
  ``t5``, ``vit``, … with the config class's defaults;
- a config class name: ``GPT2Config``, ``LlamaConfig``;
- a model class name, which also picks the head: ``BertForSequenceClassification``,
  ``GPT2LMHeadModel``, ``LlamaModel``;
- a local directory holding ``config.json`` (or the path of a ``.json`` config), read with
  ``local_files_only=True``; its ``architectures[0]`` picks the class when transformers has it;
- a Hugging Face Hub id (``meta-llama/Llama-3.1-8B``, ``org/name@revision``): only its
  ``config.json`` is fetched, with ``huggingface_hub.hf_hub_download`` into (or from) the local
  HF cache (``HF_HUB_CACHE`` / ``HF_HOME``), then read as a local folder is; never weights nor
  any other file. ``HF_HUB_OFFLINE=1``: the cache only. ``HF_TOKEN`` (read by huggingface_hub)
  opens gated and private repos. A local path that exists wins over a hub id.

Without a model class, the head is the first of: masked LM, seq2seq LM, causal LM, image
classification, the base model (``bert`` -> ``BertForMaskedLM``, ``t5`` ->
``T5ForConditionalGeneration``, ``gpt2`` -> ``GPT2LMHeadModel``, ``vit`` ->
``ViTForImageClassification``).

``overrides`` are config fields (``{"n_layer": 2, "n_embd": 64}``); a field the config does not
have is an error (a typo would silently build the default size). The dtype is ``dtype`` if
given, else the config's own ``dtype`` (as ``from_config`` does: a ``config.json`` saying
``bfloat16`` builds bfloat16 weights), else float32.

The sample (a dict, ``model(**sample)``, CPU tensors with fixed values):

- text models: ``input_ids`` ``(batch, seq)`` int64, ``seq = seq_len`` or
  ``min(max_position_embeddings (or n_positions, max_seq_len…), 512)`` (less RoBERTa's
  ``padding_idx + 1`` position offset), 512 when the config has no maximum (T5);
- vision models: ``pixel_values`` ``(batch, num_channels, image_size, image_size)``;
- labels, so that ``output.loss`` exists and fxmem's default loss uses it: LM heads (causal,
  masked, seq2seq) get ``labels = input_ids`` (the same tensor, as HF training scripts pass
  it); sequence and image classification ``labels (batch,)``; token classification ``labels
  (batch, seq)``; question answering ``start_positions``/``end_positions``. Base models get no
  labels and fxmem's default loss (the mean of ``last_hidden_state``).

``loss_fn`` is None (fxmem's default: ``output.loss``). Sequence classification of a config
without ``pad_token_id`` (GPT-2, Llama) gets ``pad_token_id = 0``: HF refuses batches > 1
without one; a seq2seq LM without ``decoder_start_token_id`` (transformers 5's ``T5Config``)
gets ``pad_token_id``, T5's convention. The cache is HF's default: causal LMs whose config says ``use_cache`` return the
KV cache from an inference forward, and it is counted; pass ``overrides={"use_cache": False}``
to leave it out.

Training with ``transformers.Trainer``: ``trainer_step()`` is the step Trainer runs for one
optimizer step (the outputs dropped before backward, the gradient norm and clipping at
``max_grad_norm``, ``zero_grad`` to None) and ``trainer_optimizer()`` the state it keeps (its
default fused AdamW in two weight-decay groups, the scheduler, its loss and norm tensors)::

    rep = estimator.report(model, batch, step=trainer_step(max_grad_norm=1.0), optimizer=trainer_optimizer())

(``args=TrainingArguments(...)`` for both takes the settings from your arguments).  All at once,
from the arguments you give ``Trainer`` (a ``TrainingArguments``, a dict or a JSON file)::

    rep = from_training_args(model, args, device="cuda")   # b = per-device batch x accumulation steps
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from estimator.vocab.errors import InputError
from estimator.integrations._common import building_on, import_optional, pair, randint, randn, suggest

DEFAULT_SEQ = 512  # the most tokens a default sample holds
_HUB_ID = re.compile(r"^([\w.-]+/[\w.-]+)(?:@([\w./-]+))?$")  # org/name[@revision]
# Config fields that give the longest sequence a model's position embeddings allow.
_MAX_POSITIONS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "n_ctx")
# The default head, in order (a model type in several mappings gets the first).
_DEFAULT_HEADS = (
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
)
_LM_HEADS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
)


def build(
    name: str,
    batch: int,
    *,
    overrides: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype | None,
    seq_len: int | None,
    image_size: int | tuple[int, int] | None,
) -> tuple[nn.Module, dict[str, torch.Tensor], None]:
    transformers = import_optional("transformers", "transformers")
    config, model_class = _resolve(transformers, name, overrides)
    if model_class is None:
        model_class = _default_class(transformers, config)
    head = _head(transformers, model_class)
    if head == "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES" and getattr(config, "pad_token_id", 0) is None:
        config.pad_token_id = 0
    if head == "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES" and getattr(config, "decoder_start_token_id", None) is None:
        # T5's convention (its hub configs say so; transformers 5's T5Config has no default).
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
    kwargs = {} if dtype is None else {"dtype": dtype}
    with building_on(device):
        try:
            model = model_class._from_config(config, **kwargs)
        except (TypeError, ValueError, AttributeError, KeyError, ImportError) as exc:
            raise InputError(f"transformers could not build {model_class.__name__} from this config: {exc}") from exc
    return model, _sample(transformers, model, config, batch, seq_len, image_size), None


def _resolve(transformers, name: str, overrides: dict[str, Any]):
    """``(config, model class or None)`` for ``name``."""
    from transformers import CONFIG_MAPPING, PretrainedConfig, PreTrainedModel

    if not isinstance(name, str) or not name:
        raise InputError(f"the transformers model must be a non-empty string, got {name!r}")
    path = os.path.expanduser(name)
    if os.path.exists(path):
        return _from_local(transformers, path, overrides)
    if name in CONFIG_MAPPING:
        return _configured(CONFIG_MAPPING[name], overrides, name), None
    attr = getattr(transformers, name, None) if name.isidentifier() else None
    if isinstance(attr, type) and issubclass(attr, PretrainedConfig) and attr.model_type:
        return _configured(attr, overrides, name), None
    if isinstance(attr, type) and issubclass(attr, PreTrainedModel) and _config_class(attr) is not None:
        return _configured(_config_class(attr), overrides, name), attr
    looks_like_path = os.sep in name or name.startswith((".", "~")) or name.endswith(".json")
    hub_id = _HUB_ID.match(name) if not name.startswith((".", "~")) else None
    if looks_like_path and not hub_id:
        raise InputError(f"no such file or directory: {name!r} (a local config directory or .json file)")
    if hub_id:
        return _from_local(transformers, _hub_config(*hub_id.groups()), overrides)
    known = list(CONFIG_MAPPING.keys())
    raise InputError(
        f"unknown transformers model {name!r}: not a model type, a config or model class, "
        f"nor a local config directory.{suggest(name, known)} (model types: transformers.CONFIG_MAPPING)"
    )


def _hub_config(repo_id: str, revision: str | None) -> str:
    """The local folder holding ``repo_id``'s ``config.json``: ``huggingface_hub.hf_hub_download``
    of that one file (huggingface_hub 2.4, file_download.py: the cache's
    ``models--org--name/snapshots/<commit>/config.json``, ``refs/<revision>`` naming the commit),
    from the cache alone when ``HF_HUB_OFFLINE`` is set (read now, and as huggingface_hub read it
    at import)."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub import errors as hub

    where = f"{repo_id}@{revision}" if revision else repo_id
    cache = constants.HF_HUB_CACHE
    offline = constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    local = ("pass a local config instead: a folder holding the model's config.json "
             "(transformers:/path/to/folder) or the .json file")
    token = "huggingface_hub sends HF_TOKEN (or the token of `hf auth login`) when one is set"
    try:
        path = hf_hub_download(repo_id, "config.json", revision=revision, cache_dir=cache, local_files_only=offline)
    except hub.GatedRepoError as exc:
        raise InputError(f"{where!r} is a gated Hugging Face repo: accept its terms on huggingface.co and set "
                         f"HF_TOKEN ({token}), or {local}") from exc
    except hub.RepositoryNotFoundError as exc:
        raise InputError(f"no Hugging Face repo {repo_id!r} (or it is private: {token}) and no local folder of "
                         f"that name; check the id, or {local}") from exc
    except hub.RevisionNotFoundError as exc:
        raise InputError(f"the Hugging Face repo {repo_id!r} has no revision {revision!r}") from exc
    except hub.LocalEntryNotFoundError as exc:  # offline, or the Hub unreachable, and nothing cached
        why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face Hub cannot be reached"
        raise InputError(f"{where!r}: its config.json is not in the local Hugging Face cache at {cache} and {why}. "
                         f"Run with HF_HUB_OFFLINE=0 and network access (fxmem fetches config.json only), "
                         f"or {local}") from exc
    except hub.EntryNotFoundError as exc:
        raise InputError(f"the Hugging Face repo {where!r} has no config.json: is it a transformers model? "
                         f"{local[0].upper()}{local[1:]}") from exc
    except hub.HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        hint = f" ({token})" if status in (401, 403) else ""
        raise InputError(f"fetching {where!r}'s config.json from the Hugging Face Hub failed{hint}: {exc}") from exc
    except (OSError, ValueError) as exc:  # a malformed id or revision, a cache that cannot be written
        raise InputError(f"cannot fetch {where!r}'s config.json: {exc}") from exc
    return os.path.dirname(path)


def _config_class(model_class) -> type | None:
    cls = getattr(model_class, "config_class", None)
    return cls if isinstance(cls, type) and getattr(cls, "model_type", "") else None


def _check_fields(config, overrides: dict[str, Any], what: str) -> None:
    unknown = [k for k in overrides if not hasattr(config, k)]
    if unknown:
        fields = [k for k in config.to_dict() if not k.startswith("_")] + list(getattr(config, "attribute_map", {}))
        hints = "".join(suggest(k, fields, n=2) for k in unknown)
        raise InputError(f"{what} has no field {', '.join(map(repr, unknown))}.{hints}")


def _configured(config_class, overrides: dict[str, Any], what: str):
    _check_fields(config_class(), overrides, config_class.__name__)
    try:
        return config_class(**overrides)
    except (TypeError, ValueError) as exc:
        raise InputError(f"{config_class.__name__}({overrides}) for {what!r} failed: {exc}") from exc


def _from_local(transformers, path: str, overrides: dict[str, Any]):
    from transformers import AutoConfig

    folder = path
    if os.path.isfile(path):
        if not path.endswith(".json"):
            raise InputError(f"{path!r} is a file but not a .json config; pass the folder that holds config.json")
        folder = os.path.dirname(path) or "."
    elif not os.path.isfile(os.path.join(path, "config.json")):
        raise InputError(f"{path!r} holds no config.json: save the model's config there (or pass the .json file)")
    try:
        if os.path.isfile(path):
            with open(path) as f:
                raw = json.load(f)
            if "model_type" not in raw:
                raise InputError(f"{path!r} has no 'model_type' field: is it a transformers config.json?")
            config = AutoConfig.for_model(raw.pop("model_type"), **raw)
        else:
            config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except InputError:
        raise
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read the transformers config at {path!r}: {exc}") from exc
    _check_fields(config, overrides, f"the config at {path!r}")
    for key, value in overrides.items():
        setattr(config, key, value)
    model_class = None
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None) if isinstance(arch, str) and arch.isidentifier() else None
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            model_class = cls
            break
    return config, model_class


def _mapping(name: str) -> dict[str, Any]:
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, name, {})


def _default_class(transformers, config):
    model_type = config.model_type
    for mapping in _DEFAULT_HEADS:
        class_name = _mapping(mapping).get(model_type)
        if isinstance(class_name, (list, tuple)):
            class_name = class_name[0] if class_name else None
        cls = getattr(transformers, class_name, None) if class_name else None
        if cls is not None:
            return cls
    raise InputError(f"transformers has no model class for model type {model_type!r}: name the class instead")


def _head(transformers, model_class) -> str | None:
    """The name of the first auto mapping that lists ``model_class`` (its task)."""
    from transformers.models.auto import modeling_auto

    name = model_class.__name__
    for mapping in (*_LM_HEADS, "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
                    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"):
        for value in getattr(modeling_auto, mapping, {}).values():
            if name == value or (isinstance(value, (list, tuple)) and name in value):
                return mapping
    return None


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _seq(config, seq_len: int | None) -> int:
    if seq_len is not None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise InputError(f"seq_len must be a positive int, got {seq_len!r}")
        return seq_len
    text = _text_config(config)
    for field in _MAX_POSITIONS:
        value = getattr(text, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return min(value, DEFAULT_SEQ)
    return DEFAULT_SEQ


def _position_limit(model: nn.Module) -> int:
    """The longest sequence learned position embeddings allow: RoBERTa-style embeddings start
    counting at ``padding_idx + 1`` (514 positions -> 512 tokens)."""
    limit = DEFAULT_SEQ
    for name, module in model.named_modules():
        if name.endswith("position_embeddings") and isinstance(module, nn.Embedding):
            offset = module.padding_idx + 1 if module.padding_idx is not None else 0
            limit = min(limit, max(module.num_embeddings - offset, 1))
    return limit


def _sample(transformers, model, config, batch: int, seq_len, image_size) -> dict[str, torch.Tensor]:
    main = getattr(model, "main_input_name", "input_ids")
    head = _head(transformers, type(model))
    num_labels = max(int(getattr(config, "num_labels", 2) or 2), 1)
    if main == "input_ids":
        if image_size is not None:
            raise InputError(f"image_size is for vision models; {type(model).__name__} takes input_ids (use seq_len)")
        seq = _seq(config, seq_len)
        if seq_len is None:
            seq = min(seq, _position_limit(model))
        vocab = getattr(_text_config(config), "vocab_size", None)
        if not isinstance(vocab, int) or vocab < 1:
            raise InputError(f"{type(config).__name__} has no vocab_size: cannot make token ids")
        input_ids = randint(vocab, batch, seq)
        sample = {"input_ids": input_ids}
        if head in _LM_HEADS:
            sample["labels"] = input_ids
        elif head == "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES":
            sample["labels"] = randint(num_labels, batch)
        elif head == "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES":
            sample["labels"] = randint(num_labels, batch, seq)
        elif head == "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES":
            sample["start_positions"] = randint(seq, batch)
            sample["end_positions"] = randint(seq, batch)
        return sample
    if main == "pixel_values":
        if seq_len is not None:
            raise InputError(f"seq_len is for text models; {type(model).__name__} takes pixel_values (use image_size)")
        vision = getattr(config, "vision_config", None) or config
        size = image_size if image_size is not None else getattr(vision, "image_size", 224)
        h, w = pair(size, "image_size")
        channels = int(getattr(vision, "num_channels", 3) or 3)
        sample = {"pixel_values": randn(batch, channels, h, w, dtype=next(model.parameters()).dtype)}
        if head == "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES":
            sample["labels"] = randint(num_labels, batch)
        return sample
    raise InputError(
        f"{type(model).__name__} takes {main!r}: fxmem builds samples for text (input_ids) and image "
        "(pixel_values) models only; build the model yourself and pass estimator.report a sample"
    )



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
# and captured as it runs (``adamw_8bit`` only where bitsandbytes imports, and for the CUDA target).
MODELLED_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop", "adamw_8bit")


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
    device_type = _device_type(device)
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
        batch_samples = _micro_batches(batch, k)  # get_batch_samples' list: alive to the end of the step
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


def _device_type(device: Any) -> str:
    name = device.type if isinstance(device, torch.device) else str(device).strip().lower().partition(":")[0]
    if name not in ("cpu", "cuda"):
        raise InputError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return name


def _micro_batches(batch: dict[str, torch.Tensor], k: int) -> list[dict[str, torch.Tensor]]:
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
            cls, kwargs = _transformers().Trainer.get_optimizer_cls_and_kwargs(args, model)
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
            scheduler = _transformers().get_scheduler(scheduler_type, optimizer=optimizer, num_warmup_steps=warmup,
                                      num_training_steps=steps)
        where = next((p.device for p in model.parameters()), torch.device("cpu"))
        grad_scaler = torch.amp.GradScaler(_device_type(device)) if scaler else None  # accelerate's get_grad_scaler
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
    return cls(groups, **kwargs)


def _transformers():
    """``transformers``, imported the way ``build`` does (torchvision made importable first), or
    an ``InputError`` naming the extra to install."""
    return import_optional("transformers", "transformers")


def _default_optim() -> str:
    """``TrainingArguments``' default ``optim``: ``adamw_torch_fused`` on torch >= 2.8 (transformers
    5.24, training_args.py ``default_optim``), else ``adamw_torch``."""
    try:
        return str(_transformers().TrainingArguments.default_optim)
    except (InputError, ImportError, AttributeError):
        major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
        return "adamw_torch_fused" if (major, minor) >= (2, 8) else "adamw_torch"


def training_arguments(args: Any):
    """``args`` as a ``transformers.TrainingArguments``: one already, a dict of its fields, or the
    path of a JSON file holding them (``output_dir`` may be left out; built with ``use_cpu=True``:
    the target is ``report(device=)``, not this machine).  A field it does not have,
    or one set to a value fxmem does not model before ``TrainingArguments`` would need it (a
    DeepSpeed config: building it imports ``deepspeed``), raises ``InputError``."""
    transformers = _transformers()
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
    - ``optim``: one of ``MODELLED_OPTIMS`` (``adamw_8bit``: bitsandbytes installed, CUDA target);
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
    device = _device_type(device)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world_size must be a positive int, got {world_size!r}")
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"TrainingArguments {name}={value!r}: must be a positive int")
    defaults = _transformers().TrainingArguments(output_dir="fxmem-unused", report_to="none", use_cpu=True)
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
    if optim == "adamw_8bit":
        _check_bitsandbytes(device)
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


def _check_bitsandbytes(device: str) -> None:
    import importlib

    try:
        importlib.import_module("bitsandbytes")
    except ImportError:
        raise InputError("TrainingArguments optim='adamw_8bit' needs bitsandbytes, which is not installed here "
                         "(pip install bitsandbytes)") from None
    if device == "cpu":
        raise InputError("TrainingArguments optim='adamw_8bit' on the CPU: bitsandbytes' CPU 8-bit update "
                         "dequantizes the states into fp32 temporaries that fxmem does not model (its CUDA "
                         "kernel updates in place: device='cuda' is modelled)")


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
    settings = training_settings(args, device=_device_type(device), world_size=world_size)
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
                           device=_device_type(device), nan_inf_filter=settings.nan_inf_filter)
    on_cpu = _device_type(device) == "cpu"
    rep = estimator.report(
        trained, sample,
        step=_with_next_micro_batch(step_fn, settings.accumulate) if on_cpu else step_fn,
        optimizer=trainer_optimizer(args=args, device=_device_type(device)),
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
        ahead = {key: t.clone() if isinstance(t, torch.Tensor) else t for key, t in _micro_batches(batch, k)[0].items()}
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
    transformers = _transformers()
    base = _unwrap_peft(model)
    config = getattr(base, "config", None)
    if config is None:
        raise InputError(f"{type(model).__name__} has no config: pass from_training_args a sample (a dict of tensors "
                         "as the data collator makes it)")
    return _collated(_sample(transformers, base, config, rows, None, None))


def _unwrap_peft(model: nn.Module) -> nn.Module:
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

    model = _unwrap_peft(model)
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
        _transformers()
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except (InputError, ImportError):
        return False
    model = _unwrap_peft(model)
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
