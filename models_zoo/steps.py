"""Training steps as users write them, for ``estimator.report(model, sample, step=fn)``.

Each ``Case`` is a model, a sample, a step function ``fn(model, sample, state)`` and the state
factory ``model -> state`` (``optimizer=``) of one pattern that real training loops use and that
fxmem's built-in step does not cover: the output dropped before backward (Hugging Face's
``Trainer``, Lightning, torchtitan), gradients zeroed first or to zero, an EMA copy of the
weights, two optimizers (a GAN), several losses, two backwards through one graph, the optimizer
step fused into backward, autocast with a ``GradScaler`` and clipping, Adagrad over frozen
layers, test-time augmentation, and a nanoGPT-style loop.  ``validators/steps.py`` measures
each against the same step run for real on the CPU, ``validators/gpu.py`` on a GPU (the steps
take their device from the model and the sample: ``x.new_ones``, ``torch.autocast(x.device.type)``,
a ``GradScaler`` for the parameters' device); the tests use them too.  Copy any of them as a
starting point for your own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    """Two hidden layers and a classifier: enough ops for every phase to allocate."""

    def __init__(self, d: int = 32, hidden: int = 96, classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.LayerNorm(hidden), nn.Linear(hidden, hidden),
                                  nn.ReLU())
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.body(x))


def net(d: int = 32, hidden: int = 96) -> nn.Module:
    torch.manual_seed(0)
    return Net(d, hidden)


def wide() -> nn.Module:
    """Parameters dominate: where fusing the optimizer step into backward pays."""
    torch.manual_seed(0)
    return Net(d=256, hidden=512)


def frozen_net() -> nn.Module:
    """The first layer frozen (``requires_grad=False``)."""
    model = net()
    model.body[0].requires_grad_(False)
    return model


def data(b: int = 8, d: int = 32, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)``: ``b`` rows of ``d`` features and their class labels."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, d, generator=g), torch.randint(0, classes, (b,), generator=g)


# -- steps over Net and (x, y) ---------------------------------------------------------------------
def loss_only(model, sample, opt):
    """Trainer / Lightning: a loss helper returns the loss only, the output dies before backward."""
    x, y = sample
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def zero_first(model, sample, opt):
    """Gradients zeroed at the start: the previous step's are alive until then."""
    opt.zero_grad()
    x, y = sample
    F.cross_entropy(model(x), y).backward()
    opt.step()


def zero_to_zero(model, sample, opt):
    """``zero_grad(set_to_none=False)``: gradients live across steps, accumulated in place."""
    x, y = sample
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def several_losses(model, sample, opt):
    """A sum of losses on the features and the logits."""
    x, y = sample
    h = model.body(x)
    logits = model.head(h)
    loss = F.cross_entropy(logits, y) + 0.1 * h.pow(2).mean() + 0.01 * logits.logsumexp(-1).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def two_backwards(model, sample, opt):
    """Two losses through one graph: the first backward keeps it (``retain_graph``)."""
    x, y = sample
    h = model.body(x)
    main = F.cross_entropy(model.head(h), y)
    aux = h.pow(2).mean()
    main.backward(retain_graph=True)
    aux.backward()
    opt.step()
    opt.zero_grad()


def clipped(model, sample, opt):
    """Clipping at 1.0 (foreach, as on real tensors) and the loss logged with ``.item()``."""
    x, y = sample
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss.item()


def ema_state(model):
    """AdamW and ``torch.optim.swa_utils.AveragedModel`` EMA weights (decay 0.999)."""
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.999))
    return torch.optim.AdamW(model.parameters()), ema


def ema_step(model, sample, state):
    opt, ema = state
    loss_only(model, sample, opt)
    ema.update_parameters(model)


def manual_ema_state(model):
    """SGD with momentum and a hand-kept list of EMA weights."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), [p.detach().clone() for p in model.parameters()]


def manual_ema_step(model, sample, state):
    opt, shadow = state
    loss_only(model, sample, opt)
    with torch.no_grad():
        torch._foreach_lerp_(shadow, [p.detach() for p in model.parameters()], 0.001)


def fused_state(model):
    """The optimizer step in backward (PyTorch's "How to save memory by fusing the optimizer step
    into the backward pass"): one optimizer per parameter, stepped as its gradient is ready."""
    optimizers = {p: torch.optim.Adam([p]) for p in model.parameters()}

    def hook(p):
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    return optimizers


def fused_step(model, sample, state):
    x, y = sample
    F.cross_entropy(model(x), y).backward()


def amp_state(model):
    """AdamW and a ``GradScaler`` for the model's device (it scales bf16 here only to exercise the
    scaler's own memory)."""
    device = next(model.parameters()).device.type
    return torch.optim.AdamW(model.parameters()), torch.amp.GradScaler(device, init_scale=2.0**4)


def amp_step(model, sample, state):
    """bf16 autocast, scaled backward, unscale, clip, scaler step."""
    opt, scaler = state
    x, y = sample
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def tta(model, sample, state):
    """Test-time augmentation (inference): two no-grad forwards, averaged."""
    x, _ = sample
    with torch.no_grad():
        return (model(x).softmax(-1) + model(x.flip(-1)).softmax(-1)) / 2


# -- a GAN: two models, two optimizers ---------------------------------------------------------------
class GAN(nn.Module):
    def __init__(self, z: int = 16, d: int = 48, hidden: int = 64):
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(z, hidden), nn.ReLU(), nn.Linear(hidden, d))
        self.discriminator = nn.Sequential(nn.Linear(d, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, 1))


def gan(z: int = 16, d: int = 48, hidden: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return GAN(z, d, hidden)


def gan_data(b: int, d: int = 48, z: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``(real, z)``: ``b`` real samples and ``b`` latent vectors."""
    g = torch.Generator().manual_seed(2)
    return torch.randn(b, d, generator=g), torch.randn(b, z, generator=g)


def gan_state(model):
    return (torch.optim.Adam(model.generator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
            torch.optim.Adam(model.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999)))


def gan_step(model, sample, state):
    """The DCGAN tutorial's step: the discriminator on real and fake, then the generator."""
    real, z = sample
    opt_g, opt_d = state
    fake = model.generator(z)
    ones, zeros = real.new_ones(real.shape[0], 1), real.new_zeros(real.shape[0], 1)
    d_loss = (F.binary_cross_entropy_with_logits(model.discriminator(real), ones)
              + F.binary_cross_entropy_with_logits(model.discriminator(fake.detach()), zeros))
    opt_d.zero_grad()
    d_loss.backward()
    opt_d.step()
    g_loss = F.binary_cross_entropy_with_logits(model.discriminator(fake), ones)
    opt_g.zero_grad()
    g_loss.backward()
    opt_g.step()


# -- a GPT loop (the zoo's GPT-2, its debug size unless named) ------------------------------------------
def gpt(size: str = "debug") -> nn.Module:
    import models_zoo

    return models_zoo.get("gpt", size)[0]


def gpt_data(b: int, size: str = "debug") -> dict[str, torch.Tensor]:
    import models_zoo

    return models_zoo.get("gpt", size)[1](b)


def gpt_loop(model, sample, state):
    """nanoGPT-style: bf16 autocast, the logits alive through backward, clipping at 1.0, AdamW,
    EMA weights, ``zero_grad(set_to_none=True)``."""
    opt, ema = state
    ids = sample["input_ids"]
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    ema.update_parameters(model)


@dataclasses.dataclass(frozen=True)
class Case:
    """One pattern: ``report(make_model(), make_sample(b), step=step, optimizer=optimizer, mode=mode)``."""

    make_model: Callable[[], nn.Module]
    make_sample: Callable[[int], Any]
    step: Callable
    optimizer: Any = "adamw"
    mode: str = "train"


CASES: dict[str, Case] = {
    "output dropped before backward": Case(net, data, loss_only),
    "zero_grad() first": Case(net, data, zero_first),
    "zero_grad(set_to_none=False)": Case(net, data, zero_to_zero),
    "several losses": Case(net, data, several_losses),
    "two backwards (retain_graph)": Case(net, data, two_backwards),
    "clip_grad_norm_ + loss.item()": Case(net, data, clipped),
    "EMA (AveragedModel)": Case(net, data, ema_step, ema_state),
    "EMA (_foreach_lerp_), SGD momentum": Case(net, data, manual_ema_step, manual_ema_state),
    "GAN: two optimizers": Case(gan, gan_data, gan_step, gan_state),
    "optimizer step fused into backward": Case(wide, lambda b: data(b, d=256), fused_step, fused_state),
    "bf16 autocast + GradScaler + clipping": Case(net, data, amp_step, amp_state),
    "Adagrad(model.parameters()), frozen layer": Case(frozen_net, data, loss_only, "adagrad"),
    "test-time augmentation (inference)": Case(net, data, tta, None, "inference"),
    "GPT: nanoGPT-style loop with EMA": Case(gpt, gpt_data, gpt_loop, ema_state),
}
