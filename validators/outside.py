"""``python -m validators.outside``: model families and layer patterns the outside checks found
wrong (issues 27 and 28), against the CPU allocator; writes docs/validation-outside.md.

Each row: ``estimator.report`` on a fresh model (seed 0) against ``validators.cpu.measure_cpu`` (or
``measure_user_step`` for ``generate()``) on another, at b in {2, 8, 32}.  The mechanisms:
in-place ops on views (the hang), the autograd engine's in-place gradient sums, library branches
on "am I being traced?" and values that follow the sample alone, kernels' hidden copies, the
probe's hooks, module conversions in ``forward``, batch-dependent programs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import estimator
from estimator.capture import steps
from validators.cpu import measure_cpu, measure_user_step
from validators.steps import Row

BATCHES = (2, 8, 32)
VOCAB = 128


# -- layer patterns ----------------------------------------------------------------------------
class ScaledInPlace(nn.Module):
    """``F.linear`` on a 3-D input returns a view of ``addmm``'s output; ``mul_`` with a Python
    number on it (the hang: the tracker read the view's ``grad_fn`` inside autograd's replay)."""

    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):  # x: (b, 8, 16)
        h = self.fc(x)
        h.mul_(0.5)
        return self.fc2(h)


class Scan(nn.Module):
    """A weight used at every step of a loop: its gradients are summed in AccumulateGrad's input
    buffer, in place for real."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64) * 0.1)

    def forward(self, x):  # x: (b, 6, 64)
        h = x[:, 0]
        for t in range(x.shape[1]):
            h = torch.tanh(h @ self.w + x[:, t])
        return h


class Shared(nn.Module):
    """``h + h``: AddBackward0 sends one tensor to both edges (summed out of place); ``h`` read by
    three ops (summed in place)."""

    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):  # x: (b, 64)
        h = self.fc(x)
        return self.fc2((h + h) * torch.tanh(h) + h.exp())


class StepSlices(nn.Module):
    """``x[:, :, t]`` at every step of a loop: eager drops the full slice of the batch dim
    (``applySlice``); a capture that recorded it would add a ``slice_backward`` (a zeroed copy of
    the gradient) per step (Mamba's selective scan, +7.7 % at b = 32)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):  # x: (b, 16, 8)
        h = self.fc(x.transpose(1, 2)).transpose(1, 2)
        return torch.stack([torch.tanh(h[:, :, t]) for t in range(h.shape[2])], dim=-1)


class UpsamplePool(nn.Module):
    """Conv, 2x nearest upsample (the CPU's channels-last loop copies input and output), global
    average pool; GroupNorm over (b, C) fixes the batch in the model's code."""

    def __init__(self):
        super().__init__()
        self.conv, self.up = nn.Conv2d(3, 16, 3, padding=1), nn.Upsample(scale_factor=2, mode="nearest")
        self.pool, self.norm, self.fc = nn.AdaptiveAvgPool2d(1), nn.GroupNorm(4, 16), nn.Linear(16, 4)

    def forward(self, x):  # x: (b, 3, 16, 16)
        return self.fc(self.norm(self.pool(self.up(self.conv(x))).flatten(1)))


class TransposedNorm(nn.Module):
    """LayerNorm over (C, H, W) of a ConvTranspose2d output: the backward's 2 x threads x N buffer."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm = nn.ConvTranspose2d(4, 8, 2, stride=2), nn.LayerNorm([8, 16, 16])
        self.fc = nn.Linear(8 * 16 * 16, 4)

    def forward(self, x):  # x: (b, 4, 8, 8)
        return self.fc(self.norm(self.conv(x)).flatten(1))


class StridedPools(nn.Module):
    """Pooling kernels copy a tensor laid out otherwise than row-major: an overlapping max pool of
    a channels-last map (its backward gets a sum's expanded gradient too) and an adaptive average
    pool of a transposed grouped ``Conv1d`` output."""

    def __init__(self):
        super().__init__()
        self.conv2d, self.pool2d = nn.Conv2d(4, 8, 3, padding=1), nn.MaxPool2d(3, 1, 1)
        self.conv1d, self.pool1d = nn.Conv1d(8, 16, 3, groups=4, padding=1), nn.AdaptiveAvgPool1d(4)

    def forward(self, x):  # x: (b, 4, 12, 12)
        h = self.pool2d(self.conv2d(x).contiguous(memory_format=torch.channels_last))
        seq = self.conv1d(h.flatten(2)[:, :, :50]).transpose(1, 2).contiguous().transpose(1, 2)
        return self.pool1d(seq).sum((1, 2)) + h.sum((1, 2, 3))


class MaxMessages(nn.Module):
    """Message passing (each node to the next two; max, then sum): ``scatter_reduce`` amax's
    backward multiplies a bool mask by a float gradient (TensorIterator copies the mask)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):  # x: (b, 32)
        h = self.fc(x)
        src = torch.arange(2 * x.shape[0]) % x.shape[0]
        dst = (src + 1) % x.shape[0]
        msg = h[src]
        agg = torch.zeros_like(h).scatter_reduce(0, dst[:, None].expand(-1, 32), msg, "amax", include_self=False)
        return agg.index_add(0, dst, msg)


class ComplexWeights(nn.Module):
    """A complex-valued parameter; ``abs`` of a complex tensor computes into a complex temporary."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16, dtype=torch.complex64))
        self.fc = nn.Linear(16, 4)

    def forward(self, x):  # x: (b, 16)
        return self.fc((x.to(torch.complex64) @ self.w).abs())


class PackedRNN(nn.Module):
    """``pack_padded_sequence`` -> a 2-layer bidirectional LSTM (or GRU) on the packed sequence ->
    ``pad_packed_sequence`` (``pad=False``: the last hidden states): RNN.cpp's per-step loop over
    the sequences still active (each step's batch is a value of the lengths)."""

    def __init__(self, cell: str = "lstm", batch_first: bool = True, pad: bool = True):
        super().__init__()
        self.batch_first, self.pad = batch_first, pad
        self.emb = nn.Embedding(VOCAB, 16)
        self.rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[cell](16, 32, num_layers=2, bidirectional=True,
                                                          batch_first=batch_first)
        self.fc = nn.Linear(64, 3)

    def forward(self, ids, lengths):  # ids: (b, 12), lengths: (b,) in 1..12
        x = self.emb(ids) if self.batch_first else self.emb(ids).transpose(0, 1)
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=self.batch_first, enforce_sorted=False)
        out, hidden = self.rnn(packed)
        if not self.pad:
            h = hidden[0] if isinstance(hidden, tuple) else hidden
            return self.fc(torch.cat([h[-2], h[-1]], -1))
        y, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=ids.shape[1])
        return self.fc(y).sum(1)


def sequences(b: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"ids": torch.randint(0, VOCAB, (b, 12), generator=g), "lengths": torch.randint(1, 13, (b,), generator=g)}


def sum_loss(out, sample):
    return out.sum()


# -- library models (transformers, built from configs) -----------------------------------------
def _transformers():
    from estimator.integrations._common import import_optional

    return import_optional("transformers", "the outside validation")


def llama_like(name: str) -> nn.Module:
    """Qwen2 or Llama, 2 layers, grouped-query attention (seed 0)."""
    t = _transformers()
    gqa = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2)
    cls, config = {"qwen2": (t.Qwen2ForCausalLM, t.Qwen2Config), "llama": (t.LlamaForCausalLM, t.LlamaConfig)}[name]
    torch.manual_seed(0)
    return cls(config(**gqa))


def tokens(b: int, mask: bool = True, s: int = 128) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids} | ({"attention_mask": torch.ones_like(ids)} if mask else {})


def mamba() -> nn.Module:
    t = _transformers()
    torch.manual_seed(0)
    return t.MambaForCausalLM(t.MambaConfig(vocab_size=256, hidden_size=64, state_size=8, num_hidden_layers=2,
                                            expand=2, conv_kernel=4))


def mamba_sample(b: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (b, 32), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


IMAGE_TOKEN = VOCAB - 1


def llava() -> nn.Module:
    """CLIP vision tower (32 x 32 images in 16 x 16 patches), projector, Llama."""
    t = _transformers()
    vision = t.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=32, patch_size=16, projection_dim=32)
    text = t.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return t.LlavaForConditionalGeneration(t.LlavaConfig(vision_config=vision, text_config=text,
                                                         image_token_index=IMAGE_TOKEN, vision_feature_layer=-2))


def llava_sample(b: int, labels: bool = True) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB - 2, (b, 16), generator=torch.Generator().manual_seed(1))
    ids[:, 1:5] = IMAGE_TOKEN  # 4 image tokens
    sample = {"input_ids": ids, "pixel_values": torch.randn(b, 3, 32, 32, generator=torch.Generator().manual_seed(2)),
              "attention_mask": torch.ones_like(ids)}
    return sample | ({"labels": ids.clone()} if labels else {})


def switch() -> nn.Module:
    t = _transformers()
    torch.manual_seed(0)
    return t.SwitchTransformersForConditionalGeneration(t.SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        num_experts=4, expert_capacity=8, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
        decoder_start_token_id=0))


def switch_sample(b: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (b, 16), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def reformer() -> nn.Module:
    t = _transformers()
    torch.manual_seed(0)
    return t.ReformerModelWithLMHead(t.ReformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, attention_head_size=16, feed_forward_size=64,
        axial_pos_shape=(4, 8), axial_pos_embds_dim=(16, 16), max_position_embeddings=32, attn_layers=["local", "lsh"],
        local_attn_chunk_length=8, lsh_attn_chunk_length=8, num_buckets=4, is_decoder=True)).eval()


def reformer_sample(b: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, VOCAB, (b, 32), generator=torch.Generator().manual_seed(1))}


def detr() -> nn.Module:
    """DETR (a 4-stage ResNet from its config, 1 + 1 layers, 10 queries, 5 classes): its loss
    matches predictions to targets with ``scipy.optimize.linear_sum_assignment`` on the host."""
    t = _transformers()
    backbone = t.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 32, 64], depths=[1, 1, 1, 1],
                              out_features=["stage4"])
    torch.manual_seed(0)
    return t.DetrForObjectDetection(t.DetrConfig(
        use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False, d_model=32, encoder_layers=1,
        decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        num_queries=10, num_labels=5))


def detr_sample(b: int) -> dict[str, Any]:
    """64 x 64 images; ``labels``: one dict per image (1 to 4 boxes), a row list."""
    g = torch.Generator().manual_seed(0)
    labels = [{"class_labels": torch.randint(0, 5, (n,), generator=g), "boxes": torch.rand(n, 4, generator=g) * 0.5 + 0.25}
              for n in torch.randint(1, 5, (b,), generator=g).tolist()]
    return {"pixel_values": torch.randn(b, 3, 64, 64, generator=g), "pixel_mask": torch.ones(b, 64, 64, dtype=torch.long),
            "labels": labels}


# -- the cases ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    make_model: Callable[[], nn.Module]
    make_sample: Callable[[int], Any]
    mode: str = "train"
    loss_fn: Callable | None = None
    data_dependent: str = "max"
    generate: int = 0  # new tokens (mode="generate")
    what: str = ""


def _fixed(cls: type[nn.Module], *args, **kwargs) -> Callable[[], nn.Module]:
    def make():
        torch.manual_seed(0)
        return cls(*args, **kwargs)
    return make


def _randn(*shape: int) -> Callable[[int], torch.Tensor]:
    return lambda b: torch.randn(b, *shape, generator=torch.Generator().manual_seed(0))


CASES: dict[str, Case] = {
    "in-place op on a linear's view": Case(_fixed(ScaledInPlace), _randn(8, 16), loss_fn=sum_loss,
                                           what="the hang (28.1)"),
    "weight used at every step (loop)": Case(_fixed(Scan), _randn(6, 64), loss_fn=sum_loss,
                                             what="in-place gradient sums (28.2)"),
    "h + h, h read three times": Case(_fixed(Shared), _randn(64), loss_fn=sum_loss, what="gradient sums (28.2)"),
    "x[:, :, t] in a loop": Case(_fixed(StepSlices), _randn(16, 8), loss_fn=sum_loss,
                                 what="full slices of the batch dim dropped as eager drops them"),
    "packed LSTM (pack_padded_sequence)": Case(_fixed(PackedRNN), sequences, loss_fn=sum_loss, data_dependent="sample",
                                               what="packed sequences, lengths from the sample (28.3)"),
    "packed GRU, last hidden state": Case(_fixed(PackedRNN, "gru", pad=False), sequences, loss_fn=sum_loss,
                                          data_dependent="sample", what="(28.3)"),
    "Mamba (transformers)": Case(mamba, mamba_sample, what="in-place gradient sums (28.2), full slices"),
    "Qwen2, all-ones mask (transformers)": Case(lambda: llama_like("qwen2"), tokens,
                                                what="the causal mask's real branch (27.1)"),
    "Llama, no mask (transformers)": Case(lambda: llama_like("llama"), lambda b: tokens(b, mask=False),
                                          what="packed-sequence check's real branch (27.1)"),
    "LLaVA train (transformers)": Case(llava, llava_sample, what="the probe's hooks (28.3)"),
    "LLaVA inference (transformers)": Case(llava, llava_sample, mode="inference", what="(28.3)"),
    "LLaVA generate (transformers)": Case(lambda: llava().eval(), lambda b: llava_sample(b, labels=False),
                                          mode="generate", generate=3, what="(28.3)"),
    "DETR train (transformers)": Case(detr, detr_sample, what="a matching on the host (.numpy(), scipy), per-image "
                                                               "targets (28.3)"),
    "Switch Transformers, sample sizes": Case(switch, switch_sample, data_dependent="sample",
                                              what="module.to() in forward, f-string expert names (28.4)"),
    "Reformer inference (transformers)": Case(reformer, reformer_sample, mode="inference",
                                              what="a loop over the batch (28.5)"),
    "GNN, scatter_reduce amax": Case(_fixed(MaxMessages), _randn(32), loss_fn=sum_loss,
                                     what="a copy inside the backward's mul (28.6)"),
    "upsample + global pool": Case(_fixed(UpsamplePool), _randn(3, 16, 16), loss_fn=sum_loss,
                                   what="the upsample kernel's copies (27.7)"),
    "strided max / adaptive pools": Case(_fixed(StridedPools), _randn(4, 12, 12), loss_fn=sum_loss,
                                         what="the pooling kernels' copies of strided tensors (27.7)"),
    "LayerNorm over (C, H, W)": Case(_fixed(TransposedNorm), _randn(4, 8, 8), loss_fn=sum_loss,
                                     what="the backward's per-thread buffer (27.7)"),
    "complex-valued weights, inference": Case(_fixed(ComplexWeights), _randn(16), mode="inference",
                                              what="abs's complex temporary (27.8)"),
}


def run_case(name: str, batch: int) -> Row:
    case = CASES[name]
    if case.generate:
        generation = steps.Generation(case.generate, None)
        rep = estimator.report(case.make_model(), case.make_sample(batch), mode="generate", new_tokens=case.generate,
                               device="cpu")
        measured = measure_user_step(case.make_model(), case.make_sample(batch), generation, None, "generate")
    else:
        rep = estimator.report(case.make_model(), case.make_sample(batch), mode=case.mode, loss_fn=case.loss_fn,
                               data_dependent=case.data_dependent, device="cpu")
        measured = measure_cpu(case.make_model(), case.make_sample(batch), mode=case.mode, loss_fn=case.loss_fn)
    return Row(name, batch, rep.peak_bytes, measured.peak_bytes)


def to_markdown(found: list[Row], command: str) -> str:
    errors = [abs(r.error) for r in found]
    lines = [
        "# Validation: the outside checks' cases",
        "",
        "Model families and layer patterns found wrong by outside checks (issues 27 and 28), each against "
        "the CPU allocator (`validators.cpu`): predicted `estimator.report(...).peak_bytes` and the measured "
        "peak of the same step on another instance (seed 0).",
        "",
        f"Reproduce: `{command}`. {len(found)} cases; median |error| {statistics.median(errors):.3f} %, "
        f"largest {max(errors):.3f} %.",
        "",
        "| case | what it checks | b | predicted (B) | measured (B) | error |",
        "|---|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {r.case} | {CASES[r.case].what} | {r.batch} | {r.predicted:,} | {r.measured:,} | {r.error:+.3f} % |"
              for r in found]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validators.outside", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="run the cases whose name contains this text (does not write the docs)")
    parser.add_argument("--markdown", type=Path, default=Path("docs/validation-outside.md"))
    parser.add_argument("--json", type=Path, default=Path("docs/validation-outside.json"))
    args = parser.parse_args(argv)
    found = []
    for name in CASES:
        if args.only and args.only not in name:
            continue
        for b in BATCHES:
            row = run_case(name, b)
            print(f"{name:40} b={b:<3} predicted {row.predicted:>12,} measured {row.measured:>12,} "
                  f"error {row.error:+.3f} %", flush=True)
            found.append(row)
    if not args.only:
        args.markdown.write_text(to_markdown(found, "PYTHONPATH=. python -m validators.outside"))
        args.json.write_text(json.dumps([asdict(r) | {"error_pct": r.error} for r in found], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
