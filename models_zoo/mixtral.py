"""transformers' Mixtral (sparse mixture-of-experts decoder), built from a config object.

Needs the ``transformers`` package (``pip install 'fxmem[transformers]'``); nothing is
downloaded.  transformers 5 runs the experts with ``torch._grouped_mm`` by default (tokens
sorted by expert, one grouped matmul): static shapes, no data-dependent size.  ``experts``
selects transformers' other implementations (``"eager"``: a loop over the experts hit, with
``nonzero`` and ``.item()``-style checks; ``"batched_mm"``).

Sample: dict {"input_ids": (B, T) int64, "labels": same}; the loss is the model's own
(``output.loss``, next-token cross-entropy), returned by the zoo loss_fn.
"""

from dataclasses import dataclass

import torch

from models_zoo import _common

LIBRARY = "transformers"  # the model's code is transformers' (models_zoo.library)

@dataclass(frozen=True)
class Config:
    vocab_size: int = 128
    seq_len: int = 16
    hidden_size: int = 64
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_local_experts: int = 4
    num_experts_per_tok: int = 2
    experts: str = "grouped_mm"  # transformers' experts_implementation


SIZES: dict[str, Config] = {
    "debug": Config(),
    # Mixtral-8x7B's shape (46.7 B parameters): build it on the meta device.
    "8x7b": Config(vocab_size=32000, seq_len=4096, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, num_local_experts=8),
}


def _mixtral():
    from estimator.integrations._common import import_optional

    import_optional("transformers", "transformers")
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralConfig, MixtralForCausalLM


def make(cfg: Config):
    config_class, model_class = _mixtral()
    config = config_class(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, num_local_experts=cfg.num_local_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, max_position_embeddings=cfg.seq_len,
        experts_implementation=cfg.experts,
    )
    model = model_class(config)

    def make_sample(batch: int) -> dict[str, torch.Tensor]:
        ids = _common.randint(cfg.vocab_size, _common.check_batch(batch), cfg.seq_len)
        return {"input_ids": ids, "labels": ids}

    return model, make_sample, lambda output, sample: output.loss
