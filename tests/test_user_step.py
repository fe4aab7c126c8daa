"""``report(step=fn)``: the user's own training step, against the CPU measurement of the same step.

Each test writes a step as users do (the patterns of real training loops: the output dropped
before backward, zeroing first or to zero, EMA weights, two optimizers, several losses, two
backwards, the optimizer step fused into backward, autocast with a GradScaler, frozen layers
with Adagrad), predicts it with ``estimator.report(..., step=fn)`` and measures it with
``validators.cpu.measure_user_step`` (one unmeasured step, then the measured one; the bytes
alive at its start measured too).  Tolerance: 0.5 % (the zoo's); every case here is exact to
the byte on the hosts it was written on.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import estimator
from estimator import Strategy
from estimator.categories import Category
from estimator.errors import InputError
from validators.cpu import measure_cpu, measure_user_step

TOLERANCE = 0.005


class Net(nn.Module):
    """Two hidden layers and a classifier: enough ops for every phase to allocate."""

    def __init__(self, d: int = 32, hidden: int = 96, classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.LayerNorm(hidden), nn.Linear(hidden, hidden),
                                  nn.ReLU())
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.body(x))


def net() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def data(b: int = 8, d: int = 32, classes: int = 10):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, d, generator=g), torch.randint(0, classes, (b,), generator=g)


def check(make, sample, fn, optimizer="adamw", mode="train", **kwargs) -> estimator.Report:
    """The prediction of ``fn`` on a fresh model against its measurement on another."""
    rep = estimator.report(make(), sample, step=fn, optimizer=optimizer, mode=mode, **kwargs)
    measured = measure_user_step(make(), sample, fn, optimizer, mode, kwargs.get("strategy"))
    error = (rep.peak_bytes - measured.peak_bytes) / measured.peak_bytes
    assert abs(error) <= TOLERANCE, f"predicted {rep.peak_bytes:,} B, measured {measured.peak_bytes:,} B ({error:+.3%})"
    return rep


# -- the steps -----------------------------------------------------------------------------------
def plain(model, x, opt):
    """The PyTorch tutorial loop: the output alive until the step returns (the loss is the mean
    of the output, the built-in step's default)."""
    out = model(x)
    loss = out.mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return out


def loss_only(model, sample, opt):
    """Trainer / Lightning: a loss helper returns the loss only, the output dies before backward."""
    x, y = sample
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def mean_loss_only(model, x, opt):
    """``loss_only`` with the built-in step's default loss (the output's mean)."""
    loss = model(x).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def zero_first(model, sample, opt):
    """Gradients zeroed at the start: the previous step's are alive through the forward."""
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


def test_plain_loop_matches_the_built_in_step():
    # The tutorial loop is fxmem's built-in step (output kept): the same peak, to the byte.
    x, _ = data()
    rep = check(net, x, plain)
    built_in = estimator.report(net(), x, optimizer="adamw")
    assert rep.peak_bytes == built_in.peak_bytes
    assert rep.at(64) == built_in.at(64)  # the same formula in b


@pytest.mark.parametrize("fn", [loss_only, zero_first, zero_to_zero, several_losses, two_backwards],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("b", [4, 24])
def test_user_steps_match_cpu(fn, b):
    check(net, data(b), fn)


def test_dropping_the_output_is_the_built_in_keep_output_false():
    # keep_output=False is the loss-only loop; the difference is the (b, 10) fp32 logits when
    # they are alive at the peak (the optimizer step here): 40 bytes per row.
    x, _ = data(16)
    kept = estimator.report(net(), x)
    dropped = estimator.report(net(), x, keep_output=False)
    user = check(net, x, mean_loss_only)
    assert dropped.peak_bytes == user.peak_bytes
    assert kept.peak_bytes - dropped.peak_bytes == 16 * 10 * 4
    assert measure_cpu(net(), x, keep_output=False).peak_bytes == dropped.peak_bytes
    assert any("keep_output" in n for n in kept.notes)


def test_gradients_kept_between_steps_are_state():
    # set_to_none=False: every trainable parameter's gradient is alive before the step starts.
    model = net()
    rep = estimator.report(model, data(), step=zero_to_zero)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert rep.timeline.baseline[list(Category).index(Category.GRADIENT)](8) == params


# -- EMA, two optimizers, fused optimizer step ------------------------------------------------------
def ema_state(model):
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.999))
    return torch.optim.AdamW(model.parameters()), ema


def ema_step(model, sample, state):
    opt, ema = state
    loss_only(model, sample, opt)
    ema.update_parameters(model)


def manual_ema_state(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), [p.detach().clone() for p in model.parameters()]


def manual_ema_step(model, sample, state):
    opt, shadow = state
    loss_only(model, sample, opt)
    with torch.no_grad():
        torch._foreach_lerp_(shadow, [p.detach() for p in model.parameters()], 0.001)


@pytest.mark.parametrize("make_state, fn", [(ema_state, ema_step), (manual_ema_state, manual_ema_step)],
                         ids=["AveragedModel", "foreach_lerp"])
def test_ema(make_state, fn):
    rep = check(net, data(16), fn, optimizer=make_state)
    # The EMA copy is state before the step: parameters (4 B each) once more, besides the optimizer's.
    params = sum(p.numel() * 4 for p in net().parameters())
    state = rep.timeline.baseline[list(Category).index(Category.OPTIMIZER_STATE)](16)
    assert state >= params * (3 if make_state is ema_state else 2)


class GAN(nn.Module):
    def __init__(self, z: int = 16, d: int = 48):
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(z, 64), nn.ReLU(), nn.Linear(64, d))
        self.discriminator = nn.Sequential(nn.Linear(d, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))


def gan() -> nn.Module:
    torch.manual_seed(0)
    return GAN()


def gan_state(model):
    return (torch.optim.Adam(model.generator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
            torch.optim.Adam(model.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999)))


def gan_step(model, sample, state):
    """The DCGAN tutorial's step: discriminator on real and fake, then generator."""
    real, z = sample
    opt_g, opt_d = state
    fake = model.generator(z)
    ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
    d_loss = (F.binary_cross_entropy_with_logits(model.discriminator(real), ones)
              + F.binary_cross_entropy_with_logits(model.discriminator(fake.detach()), zeros))
    opt_d.zero_grad()
    d_loss.backward()
    opt_d.step()
    g_loss = F.binary_cross_entropy_with_logits(model.discriminator(fake), ones)
    opt_g.zero_grad()
    g_loss.backward()
    opt_g.step()


@pytest.mark.parametrize("b", [8, 32])
def test_two_optimizers(b):
    g = torch.Generator().manual_seed(2)
    rep = check(gan, (torch.randn(b, 48, generator=g), torch.randn(b, 16, generator=g)), gan_step, optimizer=gan_state)
    phases = {op.phase.value for op in rep.timeline.ops}
    assert phases == {"forward", "backward", "optimizer"}


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


def wide() -> nn.Module:
    torch.manual_seed(0)
    return Net(d=256, hidden=512)


def test_optimizer_step_fused_into_backward():
    # Parameters dominate (a wide net at b = 4): the fused step never holds every gradient and
    # the optimizer's temporaries of all parameters at once.
    sample = data(4, d=256)
    rep = check(wide, sample, fused_step, optimizer=fused_state)
    unfused = estimator.report(wide(), sample, step=loss_only, optimizer=lambda m: torch.optim.Adam(m.parameters()))
    assert rep.peak_bytes < unfused.peak_bytes


# -- precision, frozen parameters, checkpointing, inference -------------------------------------
def amp_state(model):
    return torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu", init_scale=2.0**4)


def amp_step(model, sample, state):
    opt, scaler = state
    x, y = sample
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def test_autocast_and_grad_scaler_in_the_step():
    check(net, data(16), amp_step, optimizer=amp_state)


def frozen_net() -> nn.Module:
    model = net()
    model.body[0].requires_grad_(False)
    return model


def test_adagrad_over_model_parameters_has_state_for_frozen_layers():
    # torch.optim.Adagrad(model.parameters()) creates a state_sum for every parameter it is given
    # in __init__, frozen ones included: what users write, and what fxmem now hands a factory.
    x, y = data(8)
    rep = estimator.report(frozen_net(), x, optimizer="adagrad")
    assert rep.peak_bytes == measure_cpu(frozen_net(), x, optimizer="adagrad").peak_bytes
    frozen = net().body[0]
    frozen_bytes = 4 * (frozen.weight.numel() + frozen.bias.numel())
    trainable_only = estimator.report(frozen_net(), x, optimizer=lambda ps: torch.optim.Adagrad(
        [p for p in ps if p.requires_grad]))
    state = list(Category).index(Category.OPTIMIZER_STATE)
    # the frozen layer's state_sum (its shape) and one fp32 step counter per parameter (2 x 4 B)
    assert rep.timeline.baseline[state](8) - trainable_only.timeline.baseline[state](8) == frozen_bytes + 2 * 4
    check(frozen_net, (x, y), loss_only, optimizer="adagrad")  # the same through step=


def test_checkpointing_combines_with_a_user_step():
    # The body's forward runs again in backward (its ops recorded in the backward phase).
    rep = check(net, data(64), loss_only, strategy=Strategy(checkpoint="body"))
    plain_ = estimator.report(net(), data(64), step=loss_only)
    recomputed = [op.op for op in rep.timeline.ops if op.phase.value == "backward" and "addmm" in op.op]
    assert len(recomputed) == 2 + len([op for op in plain_.timeline.ops if op.phase.value == "backward"
                                        and "addmm" in op.op])


def tta(model, sample, state):
    """Test-time augmentation: two no-grad forwards, averaged."""
    x, _ = sample
    with torch.no_grad():
        return (model(x).softmax(-1) + model(x.flip(-1)).softmax(-1)) / 2


@pytest.mark.parametrize("b", [4, 32])
def test_inference_step(b):
    rep = check(net, data(b), tta, optimizer=None, mode="inference")
    assert rep.breakdown[Category.GRADIENT] == 0


# -- data-dependent sizes, the model named from outside, errors ----------------------------------------
class Masked(nn.Module):
    """A loss over the tokens a boolean mask keeps: the size depends on the data."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        return self.proj(x)


def masked() -> nn.Module:
    torch.manual_seed(0)
    return Masked()


def masked_step(model, sample, opt):
    x, keep = sample
    h = model(x)
    loss = h[keep].pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_data_dependent_sizes_in_a_user_step():
    g = torch.Generator().manual_seed(3)
    sample = (torch.randn(8, 12, 16, generator=g), torch.rand(8, 12, generator=g) > 0.5)
    check(masked, sample, masked_step, data_dependent="sample")
    bound = estimator.report(masked(), sample, step=masked_step)  # "max": every token kept
    assert bound.peak_bytes >= estimator.report(masked(), sample, step=masked_step, data_dependent="sample").peak_bytes


MODEL = net()


def global_model_step(model, sample, opt):
    """A step that uses the global model rather than its argument: the capture runs it on the copy."""
    x, y = sample
    loss = F.cross_entropy(MODEL(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_step_that_names_the_model_globally():
    before = {name: p.detach().clone() for name, p in MODEL.named_parameters()}
    rep = estimator.report(MODEL, data(), step=global_model_step)
    assert rep.peak_bytes == estimator.report(net(), data(), step=loss_only).peak_bytes
    assert all(torch.equal(p, before[name]) for name, p in MODEL.named_parameters())  # the user's model untouched


def test_user_state_objects_are_not_touched():
    model = net()
    rep = estimator.report(model, data(), step=amp_step, optimizer=amp_state)
    assert rep.peak_bytes > 0
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("kwargs, message", [
    ({"step": 3}, "step must be a callable"),
    ({"step": loss_only, "loss_fn": lambda o, s: o.sum()}, "loss_fn"),
    ({"step": loss_only, "amp": "bf16"}, "amp"),
    ({"step": loss_only, "keep_output": False}, "keep_output"),
    ({"step": loss_only, "strategy": Strategy(accumulate=2)}, "cannot combine with step="),
    ({"keep_output": "no"}, "keep_output must be True or False"),
])
def test_bad_step_arguments(kwargs, message):
    with pytest.raises(InputError, match=message):
        estimator.report(net(), data(), **kwargs)


def broken_step(model, sample, opt):
    x, _ = sample
    return model(x).reshape(3, -1, 7)  # not a valid shape: fails as a real run would


def test_a_failing_step_names_its_line():
    with pytest.raises(estimator.errors.CaptureError, match="broken_step"):
        estimator.report(net(), data(), step=broken_step)


def raising_factory(model):
    raise ValueError("no such optimizer")


def test_a_failing_state_factory_is_named():
    with pytest.raises(InputError, match="raising_factory raised ValueError: no such optimizer"):
        estimator.report(net(), data(), step=loss_only, optimizer=raising_factory)


# -- zoo models: the output dropped, and a real loop's step --------------------------------------
@pytest.mark.parametrize("name", ["gpt", "bert", "resnet", "lstm_lm"])
def test_zoo_keep_output_false_matches_cpu(name):
    import models_zoo

    def make():
        return models_zoo.get(name, "debug")

    model, make_sample, loss_fn = make()
    rep = estimator.report(model, make_sample(4), loss_fn=loss_fn, keep_output=False)
    model, make_sample, loss_fn = make()
    measured = measure_cpu(model, make_sample(4), loss_fn=loss_fn, keep_output=False)
    assert abs(rep.peak_bytes - measured.peak_bytes) <= TOLERANCE * measured.peak_bytes, (rep.peak_bytes, measured)


def gpt_loop(model, sample, state):
    """nanoGPT-style: bf16 autocast, clipping at 1.0, AdamW, EMA weights, zero_grad(set_to_none=True)."""
    opt, ema = state
    ids = sample["input_ids"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    ema.update_parameters(model)


@pytest.mark.parametrize("b", [2, 8])
def test_zoo_gpt_real_loop(b):
    import models_zoo

    sample = models_zoo.get("gpt", "debug")[1](b)
    check(lambda: models_zoo.get("gpt", "debug")[0], sample, gpt_loop, optimizer=ema_state)


HISTORY: list[torch.Tensor] = []


def logging_step(model, sample, opt):
    """A step that keeps every loss in a global list (a common leak): named in the notes."""
    x, y = sample
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    HISTORY.append(loss.detach())


def test_tensors_the_step_keeps_are_named():
    rep = estimator.report(net(), data(), step=logging_step)
    assert any("your step keeps 1 tensor(s) alive between steps" in n for n in rep.notes)
    assert any("the step is yours (logging_step)" in n for n in rep.notes)
    assert HISTORY == []  # the capture appended to a copy of the user's list


LOGGED: list[float] = []


def logging_loss_step(model, sample, opt):
    """Logs the loss and the gradient norm with .item(): values fake tensors do not have."""
    x, y = sample
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    LOGGED.append(loss.item() + float(norm))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_logged_values_do_not_need_the_weights(device):
    logged = len(LOGGED)
    rep = estimator.report(net().to(device), data(), step=logging_loss_step)
    assert len(LOGGED) == logged  # the capture appended to a copy of the list
    assert any("were taken as 0.0" in n and "test_user_step.py" in n for n in rep.notes)
    assert rep.peak_bytes == check(net, data(), logging_loss_step).peak_bytes
