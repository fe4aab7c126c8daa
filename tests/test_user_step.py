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
import models_zoo
from estimator import Strategy
from estimator.vocab.categories import Category
from estimator.vocab.errors import InputError
from models_zoo import steps
from models_zoo.steps import (
    amp_state,
    amp_step,
    data,
    ema_state,
    ema_step,
    frozen_net,
    fused_state,
    fused_step,
    gan,
    gan_data,
    gan_state,
    gan_step,
    loss_only,
    manual_ema_state,
    manual_ema_step,
    net,
    tta,
    wide,
    zero_to_zero,
)
from validators.cpu import measure_cpu, measure_user_step

TOLERANCE = 0.005


def check(make, sample, fn, optimizer="adamw", mode="train", **kwargs) -> estimator.Report:
    """The prediction of ``fn`` on a fresh model against its measurement on another."""
    rep = estimator.report(make(), sample, step=fn, optimizer=optimizer, mode=mode, **kwargs, device="cpu")
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


def mean_loss_only(model, x, opt):
    """``loss_only`` with the built-in step's default loss (the output's mean)."""
    loss = model(x).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_plain_loop_matches_the_built_in_step():
    # The tutorial loop is fxmem's built-in step (output kept): the same peak, to the byte.
    x, _ = data()
    rep = check(net, x, plain)
    built_in = estimator.report(net(), x, optimizer="adamw", device="cpu")
    assert rep.peak_bytes == built_in.peak_bytes
    assert rep.at(64) == built_in.at(64)  # the same formula in b


@pytest.mark.parametrize("b", [4, 24])
@pytest.mark.parametrize("name", list(steps.CASES))
def test_user_steps_match_cpu(name, b):
    case = steps.CASES[name]
    check(case.make_model, case.make_sample(b), case.step, case.optimizer, case.mode)


def test_dropping_the_output_is_the_built_in_keep_output_false():
    # keep_output=False is the loss-only loop; the difference is the (b, 10) fp32 logits when
    # they are alive at the peak (the optimizer step here): 40 bytes per row.
    x, _ = data(16)
    kept = estimator.report(net(), x, device="cpu")
    dropped = estimator.report(net(), x, keep_output=False, device="cpu")
    user = check(net, x, mean_loss_only)
    assert dropped.peak_bytes == user.peak_bytes
    assert kept.peak_bytes - dropped.peak_bytes == 16 * 10 * 4
    assert measure_cpu(net(), x, keep_output=False).peak_bytes == dropped.peak_bytes
    assert any("keep_output" in n for n in kept.notes)


def test_gradients_kept_between_steps_are_state():
    # set_to_none=False: every trainable parameter's gradient is alive before the step starts.
    model = net()
    rep = estimator.report(model, data(), step=zero_to_zero, device="cpu")
    params = sum(p.numel() * 4 for p in model.parameters())
    assert rep.timeline.baseline[list(Category).index(Category.GRADIENT)](8) == params


# -- EMA, two optimizers, fused optimizer step ------------------------------------------------------
@pytest.mark.parametrize("make_state, fn", [(ema_state, ema_step), (manual_ema_state, manual_ema_step)],
                         ids=["AveragedModel", "foreach_lerp"])
def test_ema_weights_are_state(make_state, fn):
    rep = estimator.report(net(), data(16), step=fn, optimizer=make_state, device="cpu")
    # The EMA copy is state before the step: parameters (4 B each) once more, besides the optimizer's.
    params = sum(p.numel() * 4 for p in net().parameters())
    state = rep.timeline.baseline[list(Category).index(Category.OPTIMIZER_STATE)](16)
    assert state >= params * (3 if make_state is ema_state else 2)


def test_two_optimizers_phases():
    rep = estimator.report(gan(), gan_data(8), step=gan_step, optimizer=gan_state, device="cpu")
    phases = [op.phase.value for op in rep.timeline.ops]
    # forward D, backward, step D, forward G (through D), backward, step G
    assert [p for i, p in enumerate(phases) if i == 0 or p != phases[i - 1]] == [
        "forward", "backward", "optimizer", "forward", "backward", "optimizer"]
    phases = set(phases)
    assert phases == {"forward", "backward", "optimizer"}


def test_optimizer_step_fused_into_backward():
    # Parameters dominate (a wide net at b = 4): the fused step never holds every gradient and
    # the optimizer's temporaries of all parameters at once.
    sample = data(4, d=256)
    rep = estimator.report(wide(), sample, step=fused_step, optimizer=fused_state, device="cpu")
    unfused = estimator.report(wide(), sample, step=loss_only, optimizer=lambda m: torch.optim.Adam(m.parameters()),
                               device="cpu")
    assert rep.peak_bytes < unfused.peak_bytes


# -- precision, frozen parameters, checkpointing, inference -------------------------------------
def test_adagrad_over_model_parameters_has_state_for_frozen_layers():
    # torch.optim.Adagrad(model.parameters()) creates a state_sum for every parameter it is given
    # in __init__, frozen ones included: what users write, and what fxmem now hands a factory.
    x, y = data(8)
    rep = estimator.report(frozen_net(), x, optimizer="adagrad", device="cpu")
    assert rep.peak_bytes == measure_cpu(frozen_net(), x, optimizer="adagrad").peak_bytes
    frozen = net().body[0]
    frozen_bytes = 4 * (frozen.weight.numel() + frozen.bias.numel())
    trainable_only = estimator.report(frozen_net(), x, optimizer=lambda ps: torch.optim.Adagrad(
        [p for p in ps if p.requires_grad]), device="cpu")
    state = list(Category).index(Category.OPTIMIZER_STATE)
    # the frozen layer's state_sum (its shape) and one fp32 step counter per parameter (2 x 4 B)
    assert rep.timeline.baseline[state](8) - trainable_only.timeline.baseline[state](8) == frozen_bytes + 2 * 4


def test_checkpointing_combines_with_a_user_step():
    # The body's forward runs again in backward (its ops recorded in the backward phase).
    rep = check(net, data(64), loss_only, strategy=Strategy(checkpoint="body"))
    plain_ = estimator.report(net(), data(64), step=loss_only, device="cpu")
    recomputed = [op.op for op in rep.timeline.ops if op.phase.value == "backward" and "addmm" in op.op]
    assert len(recomputed) == 2 + len([op for op in plain_.timeline.ops if op.phase.value == "backward"
                                        and "addmm" in op.op])


def _grad_step(model, sample, optimizer):
    """The gradients by ``torch.autograd.grad``, then set on the parameters (a step that clips or
    inspects them before they land in ``.grad``)."""
    loss = model(**sample).float().mean()
    params = [p for p in model.parameters() if p.requires_grad]
    for p, g in zip(params, torch.autograd.grad(loss, params)):
        p.grad = g
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _backward_step(model, sample, optimizer):
    model(**sample).float().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_torch_autograd_grad_recomputes_with_the_targets_kernels():
    """``torch.autograd.grad`` runs the engine inside the CUDA target's substitutions as ``backward()``
    does (``corrections/mode.py``): a checkpointed block's recomputation takes the same attention
    kernel as its forward (it took the CPU's, and torch.utils.checkpoint raised "a different number
    of tensors was saved"), and the step costs what the same step with ``backward()`` costs."""
    from models_zoo.gpt import Block

    model, sample_fn, _ = models_zoo.get("gpt", "debug")
    by_grad, by_backward = (estimator.report(model, sample_fn(4), batch=4, step=step, optimizer="adamw",
                                             strategy=Strategy(checkpoint=Block), gpu="H100")
                            for step in (_grad_step, _backward_step))
    assert by_grad.peak_bytes == by_backward.peak_bytes
    assert by_grad.cuda.allocated == by_backward.cuda.allocated


def test_inference_step_has_no_training_state():
    rep = estimator.report(net(), data(4), step=tta, optimizer=None, mode="inference", device="cpu")
    assert rep.breakdown[Category.GRADIENT] == rep.breakdown[Category.OPTIMIZER_STATE] == 0


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
    bound = estimator.report(masked(), sample, step=masked_step, device="cpu")  # "max": every token kept
    assert bound.peak_bytes >= estimator.report(masked(), sample, step=masked_step, data_dependent="sample",
                                                device="cpu").peak_bytes


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
    rep = estimator.report(MODEL, data(), step=global_model_step, device="cpu")
    assert rep.peak_bytes == estimator.report(net(), data(), step=loss_only, device="cpu").peak_bytes
    assert all(torch.equal(p, before[name]) for name, p in MODEL.named_parameters())  # the user's model untouched


def test_user_state_objects_are_not_touched():
    model = net()
    rep = estimator.report(model, data(), step=amp_step, optimizer=amp_state, device="cpu")
    assert rep.peak_bytes > 0
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("kwargs, message", [
    ({"step": 3}, "step must be a callable"),
    ({"step": loss_only, "loss_fn": lambda o, s: o.sum()}, "loss_fn"),
    ({"step": loss_only, "amp": "bf16"}, "amp"),
    ({"step": loss_only, "keep_output": False}, "keep_output"),
    ({"step": loss_only, "strategy": Strategy(data_parallel=2)}, "cannot combine with step="),
    ({"keep_output": "no"}, "keep_output must be True or False"),
])
def test_bad_step_arguments(kwargs, message):
    with pytest.raises(InputError, match=message):
        estimator.report(net(), data(), **kwargs, device="cpu")


def broken_step(model, sample, opt):
    x, _ = sample
    return model(x).reshape(3, -1, 7)  # not a valid shape: fails as a real run would


def test_a_failing_step_names_its_line():
    with pytest.raises(estimator.vocab.errors.CaptureError, match="broken_step"):
        estimator.report(net(), data(), step=broken_step, device="cpu")


def raising_factory(model):
    raise ValueError("no such optimizer")


def test_a_failing_state_factory_is_named():
    with pytest.raises(InputError, match="raising_factory raised ValueError: no such optimizer"):
        estimator.report(net(), data(), step=loss_only, optimizer=raising_factory, device="cpu")


# -- zoo models: the output dropped, and a real loop's step --------------------------------------
@pytest.mark.parametrize("name", ["gpt", "bert", "lstm_lm"])
def test_zoo_keep_output_false_matches_cpu(name):
    def make():
        return models_zoo.get(name, "debug")

    model, make_sample, loss_fn = make()
    rep = estimator.report(model, make_sample(4), loss_fn=loss_fn, keep_output=False, device="cpu")
    model, make_sample, loss_fn = make()
    measured = measure_cpu(model, make_sample(4), loss_fn=loss_fn, keep_output=False)
    assert abs(rep.peak_bytes - measured.peak_bytes) <= TOLERANCE * measured.peak_bytes, (rep.peak_bytes, measured)


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
    rep = estimator.report(net(), data(), step=logging_step, device="cpu")
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
    rep = estimator.report(net().to(device), data(), step=logging_loss_step, device="cpu")
    assert len(LOGGED) == logged  # the capture appended to a copy of the list
    assert any("were taken as 0.0" in n and "test_user_step.py" in n for n in rep.notes)
    assert rep.peak_bytes == check(net, data(), logging_loss_step).peak_bytes


def cuda_amp_step(model, x, opt):
    """The built-in step with bf16 autocast, written for a GPU: torch.autocast("cuda")."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x)
        loss = out.mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return out


def test_cuda_target_autocasts_the_users_cuda_regions():
    # On the CUDA target, torch.autocast("cuda") in the user's step follows CUDA's op lists on the
    # fake CPU tensors: the same step as the built-in amp="bf16" one, to the byte (allocated and
    # reserved); without the mapping the region would be disabled (no GPU here) and run in fp32.
    x = data(16)[0]
    user = estimator.report(net(), x, step=cuda_amp_step, device="cuda")
    built_in = estimator.report(net(), x, amp="bf16", device="cuda")
    figures = lambda m: (m.allocated, m.reserved, m.step_allocated, m.step_reserved, m.workspace, m.carried)
    assert figures(user.cuda) == figures(built_in.cuda)
    assert user.peak_bytes != estimator.report(net(), x, device="cuda").peak_bytes
    with pytest.warns(UserWarning):  # the mapping is gone after the capture: without a GPU it disables itself
        assert torch.autocast("cuda").device == "cuda"


def test_a_step_that_grows_is_named():
    # logging_step appends a 4-byte loss to a list every step: no steady state.
    rep = estimator.report(net(), data(), step=logging_step, device="cpu")
    assert any("your step holds 4 B more when it returns" in n for n in rep.notes)
    assert not any("holds" in n and "more when it returns" in n
                   for n in estimator.report(net(), data(), step=loss_only, device="cpu").notes)


def cuda_scaler_state(model):
    return torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cuda")


def cuda_scaler_step(model, x, state):
    opt, scaler = state
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x).float().mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def test_cuda_target_keeps_the_users_cuda_grad_scaler():
    # GradScaler("cuda") would disable itself without a GPU: on the CUDA target it scales, so its
    # scale and growth tracker (4 B each, a 512 B block each on the GPU) are optimizer state.
    rep = estimator.report(net(), data(16)[0], step=cuda_scaler_step, optimizer=cuda_scaler_state, device="cuda")
    built_in = estimator.report(net(), data(16)[0], amp="fp16", device="cuda", keep_output=False)
    state = list(Category).index(Category.OPTIMIZER_STATE)
    assert rep.timeline.baseline[state](16) == built_in.timeline.baseline[state](16)
    with pytest.warns(UserWarning):  # the mapping is gone: without a GPU a CUDA scaler disables itself again
        assert not torch.amp.GradScaler("cuda").is_enabled()


def test_a_training_step_without_backward_is_noted():
    def logged_only(model, batch, opt):
        with torch.no_grad():
            return model(batch).sum().item()

    def trains(model, batch, opt):
        model(batch).sum().backward()
        opt.step()
        opt.zero_grad()

    def noted(fn):
        rep = estimator.report(torch.nn.Linear(8, 8), torch.randn(4, 8), step=fn, optimizer="sgd", device="cpu")
        return [note for note in rep.notes if "ran no backward" in note]

    assert len(noted(logged_only)) == 1 and noted(trains) == []
