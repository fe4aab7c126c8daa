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

Training with ``transformers.Trainer``: ``estimator.integrations.trainer`` (the optimizer step it
runs: ``trainer_step``, ``trainer_optimizer``) and ``estimator.integrations.training_args``
(``from_training_args``: the arguments you give ``Trainer`` -> a report).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch
from torch import nn

from estimator.integrations import bitsandbytes
from estimator.integrations._common import building_on, import_optional, pair, randint, randn, suggest
from estimator.vocab.errors import InputError

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
    quantization: Any = None,
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
    if quantization is not False:
        model = bitsandbytes.quantize_transformers(transformers, model, config, quantization)
    return model, make_sample(transformers, model, config, batch, seq_len, image_size), None


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


def make_sample(transformers, model, config, batch: int, seq_len, image_size) -> dict[str, torch.Tensor]:
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
