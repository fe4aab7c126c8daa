"""``python -m validators.random_models``: seeded random models against the CPU allocator.

Three families of small models, each built from a seed (the same model on every host), each
estimated on the CPU target and measured by ``validators.cpu.measure_cpu`` at b ∈ {1, 3, 17}, in
training and inference:

- ``blocks``: one block of LSTM (1-2 layers, uni/bidirectional), scaled-dot-product attention
  (causal or not), MLP, or a conv stack with BatchNorm, pools and grouped convolutions;
- ``convs``: a stem and 2-6 random blocks of convolutions (depthwise, transposed, 1x1), GroupNorm,
  BatchNorm, a channels-last LayerNorm, nearest/bilinear upsampling, pools, activations and
  dropout, then a random global pool and a random loss and optimizer;
- ``tokens``: token language models: an embedding, 1-4 blocks of nn.MultiheadAttention, FFN, depthwise
  or full conv1d, GRU, RMSNorm or masked SDPA, a head (tied or not), fp32 or bf16, cross-entropy
  with ``ignore_index``.

Each row prints predicted and measured bytes; the summary counts exact rows and lists the others.
Exit status 1 when a row is not exact or fails.  Issue 27 found its last under-estimates this way
(oneDNN's one-row LSTM scratchpad, GroupNorm's buffers and layout, upsampling, channels-last samples,
an RNN's input projection); a regression there shows up here first.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys

import torch
import torch.nn.functional as F
from torch import nn

BATCHES = (1, 3, 17)
MODES = ("train", "inference")


# -- blocks ---------------------------------------------------------------------------------------
class _Attention(nn.Module):
    def __init__(self, d: int, heads: int, causal: bool):
        super().__init__()
        self.qkv, self.out, self.heads, self.causal = nn.Linear(d, 3 * d), nn.Linear(d, d), heads, causal

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    def __init__(self, rng: random.Random):
        super().__init__()
        self.kind, d = rng.choice(["lstm", "attn", "mlp", "conv"]), rng.choice([16, 32, 48])
        self.d = d
        if self.kind == "lstm":
            self.body = nn.LSTM(d, d, num_layers=rng.choice([1, 2]), batch_first=True, bidirectional=rng.random() < .5)
            self.head = nn.Linear(d * (2 if self.body.bidirectional else 1), 5)
        elif self.kind == "attn":
            self.body = nn.Sequential(_Attention(d, rng.choice([2, 4]), rng.random() < .5), nn.LayerNorm(d), nn.GELU())
            self.head = nn.Linear(d, 5)
        elif self.kind == "mlp":
            self.body = nn.Sequential(nn.Linear(d, 2 * d), rng.choice([nn.ReLU(), nn.GELU(), nn.SiLU()]), nn.Dropout(.1),
                                      nn.Linear(2 * d, d))
            self.head = nn.Linear(d, 5)
        else:
            self.c = rng.choice([3, 8])
            self.body = nn.Sequential(nn.Conv2d(self.c, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      rng.choice([nn.MaxPool2d(2), nn.AvgPool2d(2), nn.AdaptiveAvgPool2d(4)]),
                                      nn.Conv2d(16, 8, 3, groups=rng.choice([1, 8])), nn.GELU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
            self.head = nn.Linear(8, 5)

    def forward(self, x):
        y = self.body(x)
        if self.kind == "lstm":
            y = y[0]
        return self.head(y.mean(1) if y.dim() == 3 else y)


def _blocks(seed: int):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = _Block(rng)
    optimizer = rng.choice(["adamw", "sgd", "adam"])

    def sample(b: int) -> torch.Tensor:
        if model.kind == "conv":
            return torch.randn(b, model.c, 12, 12)
        return torch.randn(b, model.d) if model.kind == "mlp" else torch.randn(b, 10, model.d)

    return model, sample, optimizer, lambda out, x: out.float().pow(2).mean(), model.kind


# -- convs ----------------------------------------------------------------------------------------
class _LayerNorm2d(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.ln = nn.LayerNorm(c)

    def forward(self, x):
        return self.ln(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _conv_block(rng: random.Random, c: int) -> nn.Module:
    kind = rng.choice(["conv", "dw", "tconv", "gn", "bn", "ln", "up", "pool", "apool", "act", "drop", "conv1x1"])
    return {
        "conv": lambda: nn.Conv2d(c, c, 3, padding=1), "dw": lambda: nn.Conv2d(c, c, 3, padding=1, groups=c),
        "tconv": lambda: nn.ConvTranspose2d(c, c, 2, stride=2), "gn": lambda: nn.GroupNorm(2, c),
        "bn": lambda: nn.BatchNorm2d(c), "ln": lambda: _LayerNorm2d(c),
        "up": lambda: nn.Upsample(scale_factor=2, mode=rng.choice(["nearest", "bilinear"])),
        "pool": lambda: rng.choice([nn.MaxPool2d(2, ceil_mode=True), nn.AvgPool2d(2, ceil_mode=True)]),
        "apool": lambda: nn.AdaptiveAvgPool2d(rng.choice([2, 3, 5])),
        "act": lambda: rng.choice([nn.ReLU(), nn.GELU(), nn.SiLU(), nn.Hardswish(), nn.LeakyReLU(0.1), nn.Tanh()]),
        "drop": lambda: nn.Dropout2d(0.1), "conv1x1": lambda: nn.Conv2d(c, c, 1),
    }[kind]()


class _ConvNet(nn.Module):
    def __init__(self, rng: random.Random):
        super().__init__()
        c = rng.choice([4, 8])
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.body = nn.Sequential(*[_conv_block(rng, c) for _ in range(rng.randint(2, 6))])
        self.head, self.pool = nn.Linear(c, 5), rng.choice(["mean", "amax", "adaptive"])

    def forward(self, x):
        y = self.body(self.stem(x))
        y = y.mean((2, 3)) if self.pool == "mean" else y.amax((2, 3)) if self.pool == "amax" else \
            F.adaptive_avg_pool2d(y, 1).flatten(1)
        return self.head(y)


_LOSSES = {
    "ce": lambda o, x: F.cross_entropy(o, torch.zeros(o.shape[0], dtype=torch.long)),
    "mse": lambda o, x: F.mse_loss(o, torch.zeros_like(o)),
    "bce": lambda o, x: F.binary_cross_entropy_with_logits(o, torch.ones_like(o)),
    "l1": lambda o, x: F.smooth_l1_loss(o, torch.zeros_like(o)),
    "mean": lambda o, x: o.mean(),
}


def _convs(seed: int):
    rng = random.Random(1000 + seed)
    torch.manual_seed(seed)
    model = _ConvNet(rng)
    optimizer = rng.choice(["adamw", "sgd", "adam", "rmsprop", "adagrad"])
    loss = rng.choice(list(_LOSSES))
    hw = rng.choice([8, 12, 16])
    label = f"{[type(b).__name__ for b in model.body]} {model.pool} {loss}"
    return model, lambda b: torch.randn(b, 3, hw, hw), optimizer, _LOSSES[loss], label


# -- tokens ---------------------------------------------------------------------------------------
class _TokenBlock(nn.Module):
    def __init__(self, rng: random.Random, d: int):
        super().__init__()
        self.kind = rng.choice(["mha", "ffn", "conv1d", "gru", "rms", "sdpa_mask"])
        self.m = {
            "mha": lambda: nn.MultiheadAttention(d, rng.choice([1, 2, 4]), batch_first=True, dropout=rng.choice([0., .1])),
            "ffn": lambda: nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 3 * d),
                                         rng.choice([nn.GELU(), nn.SiLU(), nn.ReLU()]), nn.Linear(3 * d, d)),
            "conv1d": lambda: nn.Conv1d(d, d, rng.choice([1, 3, 5]), padding="same", groups=rng.choice([1, d])),
            "gru": lambda: nn.GRU(d, d, batch_first=True), "rms": lambda: nn.RMSNorm(d),
            "sdpa_mask": lambda: nn.Linear(d, 3 * d),
        }[self.kind]()
        self.heads = rng.choice([1, 2, 4])

    def forward(self, x):
        if self.kind == "mha":
            return x + self.m(x, x, x, need_weights=False)[0]
        if self.kind == "conv1d":
            return x + self.m(x.transpose(1, 2)).transpose(1, 2)
        if self.kind == "gru":
            return self.m(x)[0]
        if self.kind == "sdpa_mask":
            b, t, d = x.shape
            q, k, v = self.m(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            return x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, d)
        return self.m(x)


class _TokenLM(nn.Module):
    def __init__(self, rng: random.Random):
        super().__init__()
        d, self.vocab = rng.choice([16, 32]), rng.choice([50, 97])
        self.emb = nn.Embedding(self.vocab, d)
        self.blocks = nn.Sequential(*[_TokenBlock(rng, d) for _ in range(rng.randint(1, 4))])
        self.head = nn.Linear(d, self.vocab, bias=rng.random() < .5)
        if rng.random() < .3:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.blocks(self.emb(ids)))


def _next_token_loss(out, ids):
    return F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]).float(), ids[:, 1:].reshape(-1), ignore_index=0)


def _tokens(seed: int):
    rng = random.Random(5000 + seed)
    torch.manual_seed(seed)
    model = _TokenLM(rng)
    if rng.random() < .25:
        model = model.to(torch.bfloat16)
    optimizer = rng.choice(["adamw", "sgd", "adam", "rmsprop"])
    t = rng.choice([7, 16, 33])
    label = f"{[b.kind for b in model.blocks]} {next(model.parameters()).dtype}"
    return model, lambda b: torch.randint(0, model.vocab, (b, t)), optimizer, _next_token_loss, label


FAMILIES = {"blocks": _blocks, "convs": _convs, "tokens": _tokens}


def run(families, seeds: range, batches=BATCHES):
    """Yield ``(family, seed, mode, b, predicted, measured, label)``; ``predicted`` is the error
    message where the estimate fails."""
    import estimator
    from validators.cpu import measure_cpu

    for family in families:
        for seed in seeds:
            model, sample, optimizer, loss, label = FAMILIES[family](seed)
            for mode in MODES:
                for b in batches:
                    m = copy.deepcopy(model)
                    if mode == "inference":
                        m.eval()
                    x = sample(b)
                    try:
                        predicted = estimator.report(m, x, mode=mode, optimizer=optimizer, loss_fn=loss,
                                                     device="cpu").peak_bytes
                    except estimator.FxmemError as exc:
                        predicted = f"{type(exc).__name__}: {exc}"
                    measured = measure_cpu(copy.deepcopy(m), x, mode=mode, optimizer=optimizer, loss_fn=loss).peak_bytes
                    yield family, seed, mode, b, predicted, measured, label


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validators.random_models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--seeds", nargs=2, type=int, default=(0, 20), metavar=("FIRST", "END"))
    parser.add_argument("--batches", nargs="*", type=int, default=list(BATCHES))
    args = parser.parse_args(argv)
    rows, wrong = 0, []
    for family, seed, mode, b, predicted, measured, label in run(args.families, range(*args.seeds), args.batches):
        rows += 1
        if isinstance(predicted, str):
            line = f"{family:6s} seed {seed:3d} {mode:9s} b={b:<2d} FAILED {predicted[:200]} | {label}"
        else:
            line = (f"{family:6s} seed {seed:3d} {mode:9s} b={b:<2d} predicted {predicted:>11,} measured {measured:>11,} "
                    f"{100 * (predicted - measured) / measured:+.3f} % | {label}")
        print(line, flush=True)
        if predicted != measured:
            wrong.append(line)
    print(f"{rows - len(wrong)} of {rows} exact" + "".join("\n  " + w for w in wrong))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
