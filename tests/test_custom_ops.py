"""Custom and extension ops: ``estimator.register_op`` declarations (estimator/corrections/custom_ops.py)
and the capture's error for an op without a fake kernel.

Every op here lives in the ``fxtest`` namespace, defined once at import; each test's
declarations are removed after it (fixture ``_forget``).  Exact numbers are derived in the
comments; the training case is compared with the CPU measurement (to the byte).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import Tensor, nn

import estimator
from estimator.corrections import custom_ops
from estimator.vocab.errors import CaptureError, InputError, SymbolicCaptureFailed
from estimator.vocab.symbolic import B, Poly
from validators.cpu import measure_cpu

# -- the ops (no fake kernel unless said) -------------------------------------------------------

@torch.library.custom_op("fxtest::project", mutates_args=())
def project(x: Tensor, w: Tensor) -> Tensor:
    work = x.clone()  # the workspace: one copy of x
    return work @ w


def _project_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _project_backward(ctx, grad):  # plain torch ops: nothing to declare
    x, w = ctx.saved_tensors
    return grad @ w.t(), x.t() @ grad


project.register_autograd(_project_backward, setup_context=_project_setup)


@torch.library.custom_op("fxtest::pair", mutates_args=())
def pair(x: Tensor) -> tuple[Tensor, Tensor]:
    return x * 2, x.sum(1)


@torch.library.custom_op("fxtest::faked", mutates_args=())
def faked(x: Tensor) -> Tensor:
    work = x.clone()  # a workspace its fake kernel cannot show
    return work + x


faked.register_fake(lambda x: torch.empty_like(x))


@torch.library.custom_op("fxtest::grad_op_fwd", mutates_args=())
def grad_op_fwd(x: Tensor) -> Tensor:
    return x * 3


@torch.library.custom_op("fxtest::grad_op_bwd", mutates_args=())
def grad_op_bwd(grad: Tensor) -> Tensor:
    return grad * 3


grad_op_fwd.register_fake(lambda x: torch.empty_like(x))
grad_op_fwd.register_autograd(lambda ctx, grad: torch.ops.fxtest.grad_op_bwd(grad),
                              setup_context=lambda ctx, inputs, output: None)

_LIB = torch.library.Library("fxtest", "FRAGMENT")  # a raw operator with a CPU kernel only
_LIB.define("raw(Tensor x) -> Tensor")
_LIB.impl("raw", lambda x: x * 5, "CPU")


@pytest.fixture(autouse=True)
def _forget():
    yield
    for (target, overload) in custom_ops.declarations():
        if overload.namespace == "fxtest":
            estimator.unregister_op(overload, targets=target)


class Calls(nn.Module):
    """``op(x, weight)`` (with ``weight``) or ``op(x)``, then a sum for the loss."""

    def __init__(self, op, weight: bool = False):
        super().__init__()
        self.op = op
        self.w = nn.Parameter(torch.randn(16, 32)) if weight else None

    def forward(self, x):
        out = self.op(x, self.w) if self.w is not None else self.op(x)
        return out[0] if isinstance(out, tuple) else out


class AfterScale(nn.Module):
    """``op(x * p)``: a parameter before the op, so its backward runs in training."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self.p = nn.Parameter(torch.ones(16))

    def forward(self, x):
        return self.op(x * self.p)


def _sum_loss(out, sample):
    return out.sum()


def _op(rep, name: str):
    return next(op for op in rep.timeline.ops if op.op == name)


# -- declarations ------------------------------------------------------------------------------

def test_declared_outputs_and_workspace_exact_bytes_symbolic():
    estimator.register_op(
        "fxtest::project",
        outputs=lambda x, w: x.new_empty(x.shape[0], w.shape[1]),
        workspace=lambda x, w: x.shape[0] * x.shape[1] * 4,  # SymInt arithmetic: no guard
    )
    rep = estimator.report(Calls(torch.ops.fxtest.project, weight=True), torch.randn(8, 16), mode="inference",
                           device="cpu")
    # w 16*32*4 = 2048; x 16*4 = 64b; the output (b, 32) fp32 = 128b; the workspace b*16*4 = 64b
    assert rep.peak == 256 * B + 2048
    assert rep.peak_bytes == 256 * 8 + 2048
    op = _op(rep, "fxtest.project.default")
    assert op.scratch == (Poly.of(64 * B),)
    assert sum(op.allocated, Poly()) == Poly.of(128 * B)  # the declared output, nothing else
    assert rep.path is estimator.CapturePath.SYMBOLIC
    assert rep.guards == () and (rep.valid_from, rep.valid_to) == (2, None)
    assert rep.notes == ("memory declared with estimator.register_op, not derived by fxmem: "
                         "fxtest::project (outputs and workspace)",)


def test_several_outputs_and_workspace_peaks():
    estimator.register_op(
        "fxtest::pair",
        outputs=lambda x: [torch.empty_like(x), x.new_empty(x.shape[0])],  # a list: the op's tuple
        workspace=lambda x: [x.numel() * 8, 1000],  # two local maxima inside the kernel
        targets="cpu",
    )
    rep = estimator.report(Calls(torch.ops.fxtest.pair), torch.randn(4, 16), mode="inference", device="cpu")
    # x 64b; outputs (b, 16) fp32 64b + (b,) 4b: 132b at the op; + the workspace, 128b or 1000:
    # max(260b, 132b + 1000), the first from b = 8 on (128b >= 1000)
    op = _op(rep, "fxtest.pair.default")
    assert op.total == Poly.of(132 * B)
    assert op.scratch == (Poly.of(128 * B), Poly.const(1000))
    assert rep.peak_bytes == 132 * 4 + 1000
    assert rep.at(32) == 260 * 32


def test_train_through_the_op_matches_measurement():
    # forward: a declared op without a fake kernel; backward: plain torch ops (register_autograd)
    estimator.register_op("fxtest::project", outputs=lambda x, w: x.new_empty(x.shape[0], w.shape[1]),
                          workspace=lambda x, w: x.numel() * x.element_size(), targets="cpu")
    model, sample = Calls(torch.ops.fxtest.project, weight=True), torch.randn(6, 16)
    rep = estimator.report(model, sample, optimizer="adamw", loss_fn=_sum_loss, device="cpu")
    measured = measure_cpu(Calls(torch.ops.fxtest.project, weight=True), sample, "train", "adamw", _sum_loss)
    assert rep.peak_bytes == measured.peak_bytes  # tolerance 0: every allocation is known


def test_workspace_of_an_op_with_a_fake_kernel():
    model, sample = Calls(torch.ops.fxtest.faked), torch.randn(4, 16)
    plain = estimator.report(model, sample, mode="inference", device="cpu")
    # undeclared: the fake kernel alone, unchanged: x 64b + the output 64b, no note
    assert plain.peak == 128 * B and plain.notes == ()
    estimator.register_op(faked, workspace=lambda x: x.numel() * 4)  # the CustomOpDef works too
    declared = estimator.report(model, sample, mode="inference", device="cpu")
    assert declared.peak == 192 * B  # + the workspace 64b
    assert declared.notes == ("memory declared with estimator.register_op, not derived by fxmem: "
                              "fxtest::faked (workspace)",)
    assert declared.peak_bytes == measure_cpu(Calls(torch.ops.fxtest.faked), sample, "inference").peak_bytes


def test_backward_custom_op_needs_its_own_declaration():
    model, sample = AfterScale(torch.ops.fxtest.grad_op_fwd), torch.randn(4, 16)
    with pytest.raises(CaptureError, match="fxtest::grad_op_bwd has no fake") as err:
        estimator.report(model, sample, optimizer="sgd", loss_fn=_sum_loss, device="cpu")
    assert not isinstance(err.value, SymbolicCaptureFailed)  # no concrete fallback tried: it cannot help
    estimator.register_op("fxtest::grad_op_bwd", outputs=lambda grad: torch.empty_like(grad))
    rep = estimator.report(model, sample, optimizer="sgd", loss_fn=_sum_loss, device="cpu")
    assert rep.peak_bytes == measure_cpu(AfterScale(torch.ops.fxtest.grad_op_fwd), sample, "train", "sgd",
                                         _sum_loss).peak_bytes


def test_targets_are_separate():
    estimator.register_op("fxtest::project", outputs=lambda x, w: x.new_empty(x.shape[0], w.shape[1]))
    estimator.register_op("fxtest::project", workspace=lambda x, w: 10 ** 6, targets="cuda")  # replaces cuda's
    model, sample = Calls(torch.ops.fxtest.project, weight=True), torch.randn(4, 16)
    assert estimator.report(model, sample, mode="inference", device="cpu").peak == 192 * B + 2048  # CPU: no workspace
    with pytest.raises(CaptureError, match="fxtest::project has no fake"):  # CUDA lost its outputs
        estimator.report(model, sample, mode="inference", device="cuda", gpu="H100")
    estimator.register_op("fxtest::project", outputs=lambda x, w: x.new_empty(x.shape[0], w.shape[1]),
                          workspace=lambda x, w: 10 ** 6, targets="cuda")
    rep = estimator.report(model, sample, mode="inference", device="cuda", gpu="H100")
    assert _op(rep, "fxtest.project.default").scratch == (Poly.const(10 ** 6),)
    assert "fxtest::project (outputs and workspace)" in rep.notes[0]


def test_declaring_again_replaces_and_zoo_module_reloads():
    for workspace in (100, 200):
        estimator.register_op("fxtest::faked", workspace=lambda x, n=workspace: n)
    rep = estimator.report(Calls(torch.ops.fxtest.faked), torch.randn(4, 16), mode="inference", device="cpu")
    assert _op(rep, "fxtest.faked.default").scratch == (Poly.const(200),)
    from models_zoo import custom_op

    importlib.reload(custom_op)  # the ops exist already, the declarations are made again
    model, make_sample, loss_fn = custom_op.make(custom_op.SIZES["debug"])
    assert estimator.report(model, make_sample(2), optimizer="adamw", loss_fn=loss_fn, device="cpu").peak_bytes > 0


# -- the capture's error -----------------------------------------------------------------------

@pytest.mark.parametrize("op, args", [(torch.ops.fxtest.project, "x, w"), (torch.ops.fxtest.raw, "x")],
                         ids=["custom_op-without-fake", "library-op-cpu-only"])
def test_error_names_the_op_and_the_declaration(op, args):
    name = op._qualified_op_name
    model, sample = Calls(op, weight=args == "x, w"), torch.randn(4, 16)
    with pytest.raises(CaptureError) as err:
        estimator.report(model, sample, mode="inference", device="cpu")
    message = str(err.value)
    assert message.startswith(f"{name} has no fake (meta) kernel, so fxmem cannot run it on fake tensors (at ")
    assert "test_custom_ops.py" in message and "in forward" in message  # the user's line
    example = (f'estimator.register_op("{name}", outputs=lambda {args}: torch.empty_like(x), '
               f"workspace=lambda {args}: 0)")
    assert example in message and 'README: "Custom and extension ops"' in message
    exec(example, {"estimator": estimator, "torch": torch})  # the example is a working declaration
    assert estimator.report(model, sample, mode="inference", device="cpu").peak_bytes > 0


# -- bad declarations --------------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda: estimator.register_op("fxtest::faked", workspace=4096), "workspace must be a function"),
    (lambda: estimator.register_op("fxtest::faked", outputs="empty"), "outputs must be a function"),
    (lambda: estimator.register_op("fxtest::faked"), "declares nothing"),
    (lambda: estimator.register_op("fxtest::nope", workspace=lambda x: 0), "unknown op: torch has no operator"),
    (lambda: estimator.register_op("fxtest::faked.nope", workspace=lambda x: 0), "unknown op"),
    (lambda: estimator.register_op("fused_mlp", workspace=lambda x: 0), "'namespace::name'"),
    (lambda: estimator.register_op(len, workspace=lambda x: 0), "op must be a name"),
    (lambda: estimator.register_op("fxtest::faked", workspace=lambda x: 0, targets="tpu"), "unknown target 'tpu'"),
    (lambda: estimator.register_op("fxtest::faked", workspace=lambda x: 0, targets=()), "targets is empty"),
    (lambda: estimator.register_op("fxtest::project", workspace=lambda x: 0), r"must take the op's arguments \(x, w\)"),
    (lambda: estimator.register_op("aten::constant_pad_nd", workspace=lambda *a: 0), "already models aten::constant"),
])
def test_bad_declarations_are_rejected(call, match):
    with pytest.raises(InputError, match=match):
        call()
    assert not [key for key in custom_ops.declarations() if key[1].namespace == "fxtest"]


@pytest.mark.parametrize("declaration, match", [
    (dict(workspace=lambda x: 0.5), "must give bytes as an int"),
    (dict(workspace=lambda x: -x.numel()), "is negative: -"),
    (dict(workspace=lambda x: 1 // 0), "raised ZeroDivisionError"),
    (dict(outputs=lambda x: (torch.empty_like(x), torch.empty_like(x))), "returned tuple of 2"),
    (dict(outputs=lambda x: torch.empty_like(x, device="meta")), "are on meta, not on the inputs' device"),
])
def test_bad_declared_values_fail_the_capture_by_name(declaration, match):
    estimator.register_op("fxtest::faked", **declaration)
    with pytest.raises(InputError, match=match) as err:
        estimator.report(Calls(torch.ops.fxtest.faked), torch.randn(4, 16), mode="inference", device="cpu")
    assert "fxtest::faked (estimator.register_op)" in str(err.value)
