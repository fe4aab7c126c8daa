"""An MLP-mixer-style block stack around a custom op of its own, as an extension would ship it.

``fxmem_zoo::scaled_tanh(x, gain) = tanh(x * gain)`` is a ``torch.library.custom_op`` whose
CPU kernel allocates a workspace (the product, the size of ``x``) besides its output.  It has
a fake kernel, so fxmem can run it, but only the declaration below tells fxmem about the
workspace.  Its backward is another custom op, ``fxmem_zoo::scaled_tanh_backward``, with no
fake kernel at all: its outputs and workspace are declared with ``estimator.register_op``, as a
user of an extension op would declare them.  Both declarations are made when this module is
imported; the ops are defined once per process.

Sample: dict {"x": (B, tokens, d_model) float32, "labels": (B,) int64}.
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import estimator
from models_zoo import _common


@dataclass(frozen=True)
class Config:
    d_model: int = 32  # token width
    hidden: int = 64  # width of the custom op's input (the block's expansion)
    tokens: int = 8  # tokens per sample (dim 1 of x)
    n_layer: int = 2  # residual blocks: Linear -> scaled_tanh -> Linear
    num_classes: int = 10  # logits of the head (mean over tokens)


SIZES: dict[str, Config] = {
    "debug": Config(),
    "small": Config(d_model=512, hidden=2048, tokens=64, n_layer=8),
}


# -- the custom ops (what an extension library would define) ---------------------------------

def _scaled_tanh(x: Tensor, gain: Tensor) -> Tensor:
    work = torch.mul(x, gain)  # the workspace: x's size, freed when the kernel returns
    return torch.tanh(work)


def _scaled_tanh_backward(grad: Tensor, x: Tensor, gain: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    work = torch.mul(y, y)  # the workspace: x's size
    work.mul_(grad).neg_().add_(grad)  # grad * (1 - y^2), in place (no wrapped scalar)
    grad_x = torch.mul(work, gain)
    grad_gain = work.mul_(x).view(-1, gain.shape[0]).sum(0)
    return grad_x, grad_gain


def _define_ops():
    """Define the two ops (once per process: a reloaded module finds them defined)."""
    if hasattr(torch.ops.fxmem_zoo, "scaled_tanh"):
        return
    forward = torch.library.custom_op("fxmem_zoo::scaled_tanh", mutates_args=())(_scaled_tanh)
    torch.library.custom_op("fxmem_zoo::scaled_tanh_backward", mutates_args=())(_scaled_tanh_backward)
    forward.register_fake(lambda x, gain: torch.empty_like(x))

    def setup_context(ctx, inputs, output):
        x, gain = inputs
        ctx.save_for_backward(x, gain, output)

    def backward(ctx, grad):
        x, gain, y = ctx.saved_tensors
        return torch.ops.fxmem_zoo.scaled_tanh_backward(grad, x, gain, y)

    forward.register_autograd(backward, setup_context=setup_context)


_define_ops()


# -- their memory, declared for fxmem (what a user of the extension writes) ------------------

def _workspace(x: Tensor) -> int:
    # one buffer of x's size and dtype; SymInt arithmetic is fine here (no comparison, no guard)
    return x.numel() * x.element_size()


estimator.register_op("fxmem_zoo::scaled_tanh", workspace=lambda x, gain: _workspace(x))
estimator.register_op(
    "fxmem_zoo::scaled_tanh_backward",
    outputs=lambda grad, x, gain, y: (torch.empty_like(x), torch.empty_like(gain)),
    workspace=lambda grad, x, gain, y: _workspace(x),
)


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.hidden)
        self.gain = nn.Parameter(torch.ones(cfg.hidden))
        self.down = nn.Linear(cfg.hidden, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.ops.fxmem_zoo.scaled_tanh(self.up(x), self.gain)  # (B, T, hidden)
        return x + self.down(h)


class CustomOpNet(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = nn.Linear(cfg.d_model, cfg.num_classes)

    def forward(self, x: Tensor, labels: Tensor | None = None) -> Tensor:
        # labels is accepted so model(**sample) works; the loss lives in loss_fn
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))  # (B, num_classes)


def make_sample(cfg: Config, batch: int) -> dict[str, Tensor]:
    _common.check_batch(batch)
    return {
        "x": _common.randn(batch, cfg.tokens, cfg.d_model),
        "labels": _common.randint(cfg.num_classes, batch),
    }


def loss_fn(output: Tensor, sample: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(output, sample["labels"])


def make(cfg: Config):
    return CustomOpNet(cfg), partial(make_sample, cfg), loss_fn
