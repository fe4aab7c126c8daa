"""Composite ops that take another branch on fake tensors than on real ones (both targets).

ATen's CompositeImplicitAutograd functions run in C++ above the dispatcher, so the capture sees
the aten ops they call, not the functions.  Some of them test ``isTensorSubclassLike`` /
``areAnyTensorSubclassLike`` (aten/src/ATen/TensorSubclassLikeUtils.h: true for a tensor with
the Python dispatch key -- every FakeTensor -- and for *any* tensor while a dispatch mode is
active, as the capture's ``Tracker`` is) and run an out-of-place op where a real tensor gets the
in-place one ("composite compliance"): the fake run then holds a tensor that never exists for
real.  The entries here run the real tensors' branch on the fake tensors:

- a forward composite, as a torch function (``@substitute``: the ``Substitutions`` mode routes
  the call here before the C++ composite runs); the real program's ops are called one by one, so
  autograd records the same nodes and saves the same tensors;
- a backward formula (torch/csrc/autograd/FunctionsManual.cpp), run by the autograd engine where
  no torch function is called: the out-of-place op it takes on fake tensors is replaced by its
  in-place twin (``@fake_kernel``) while the engine runs that formula's node
  (``torch._C._current_autograd_node()``), the formula's own zero-filled buffer being the
  operand it mutates.

Every site found in the sources and on torch 2.13, and what fxmem does about each, is the table
"Composite compliance branches" in docs/design.md.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.autograd import forward_ad

from estimator.corrections.mode import run_inside
from estimator.corrections.registry import fake_kernel, substitute
from estimator.vocab.categories import Target

aten = torch.ops.aten
_BOTH = (Target.CPU, Target.CUDA)
_LINEAR_ARGS = ("input", "weight", "bias")


def _autocast_pending() -> bool:
    """CPU autocast is on and its dispatch key not yet passed: ``at::linear``'s autocast wrapper
    would cast the arguments (with its weight-cast cache) before the composite runs, which a
    torch function cannot reproduce; the CUDA target's emulation casts before the substitute
    runs, with the key excluded (``cuda/autocast.py``)."""
    return (torch.is_autocast_enabled("cpu")
            and not torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutocastCPU))


@substitute(F.linear, targets=_BOTH)
def linear(spec, func, args, kwargs):
    """``at::native::linear`` (aten/src/ATen/native/Linear.cpp), torch 2.13, for a bias:

    - a 2-D input: ``addmm(bias, input, weight.t())``;
    - a contiguous 3-D input, or a contiguous strided input with a 1-D bias (and a 3-D input
      made contiguous when ``TORCH_LINEAR_FLATTEN_3D=1``): ``_flatten_nd_linear``, one
      ``addmm`` on the flattened input;
    - otherwise (a non-contiguous input of 3 or more dims: a ``batch_first`` LSTM's output, a
      ``transpose(1, 2)`` before a token-mixing Linear, ``nn.MultiheadAttention``'s in-projection
      of the transposed ``batch_first`` input): ``output = at::matmul(input, weight.t())``, then
      ``if (isTensorSubclassLike(*bias) || bias->_fw_grad(0).defined()) output = at::add(output,
      *bias); else output.add_(*bias);``.

    The first two run the same ops on fake and real tensors (the torch function is called as
    it is).  In the third, a fake bias always takes ``at::add``: a second output-sized tensor
    that real tensors never allocate (an LSTM language model's inference peaks on the logits:
    +36 % / +56 % at b = 8 / 32 before this entry, ``lstm_lm``).  Here it runs ``matmul`` and
    the in-place ``add_``, as real tensors do.  Autograd: ``add_`` on the matmul output saves
    nothing (an add's backward needs no tensor) and the matmul's nodes saved their inputs, not
    the output, so the saved tensors are those of the real run.

    Left to the composite: no bias; a bias with a forward-mode tangent (the C++ takes ``add``
    there too); the CPU target under autocast (``_autocast_pending``)."""
    bound = dict(zip(_LINEAR_ARGS, args), **kwargs)
    x, weight, bias = bound.get("input"), bound.get("weight"), bound.get("bias")
    if not all(isinstance(t, torch.Tensor) for t in (x, weight, bias)) or _autocast_pending():
        return NotImplemented
    if x.is_mkldnn or x.dim() < 3 or bias.layout != torch.strided:
        return NotImplemented
    if x.is_contiguous() and (x.dim() == 3 or (x.layout == torch.strided and weight.layout == torch.strided
                                                and bias.dim() == 1)):
        return NotImplemented  # _flatten_nd_linear
    if x.dim() == 3 and os.environ.get("TORCH_LINEAR_FLATTEN_3D") == "1":
        return NotImplemented  # input.contiguous() + _flatten_nd_linear, the same on fake tensors
    if forward_ad.unpack_dual(bias).tangent is not None:
        return NotImplemented  # bias->_fw_grad(0).defined(): at::add for real tensors too
    output = torch.matmul(x, weight.t())
    output.add_(bias)
    return output


@substitute(F.multi_head_attention_forward, targets=Target.CPU)
def multi_head_attention_forward(spec, func, args, kwargs):
    """``nn.MultiheadAttention`` with ``batch_first`` transposes its inputs, so the in-projection
    ``F.linear(q, in_proj_weight, in_proj_bias)`` (``_in_projection_packed``) gets a
    non-contiguous 3-D input: the ``linear`` branch above.  ``F.multi_head_attention_forward``
    re-dispatches to the substitution mode, which would run it with the mode popped, so its
    ``F.linear`` calls would not reach the entry: ``run_inside`` runs it with the mode active (the
    CUDA target's entry, ``cuda/attention_substitute.py``, does the same for its attention backends)."""
    return run_inside(spec, func, args, kwargs)


# ============================================================================================
# Backward formulas: out-of-place on fake tensors, in place on the formula's own zeros for real
# ============================================================================================

# out-of-place op -> (its in-place twin, the autograd nodes whose formula calls it on a zero-filled
# buffer it has just allocated).  torch/csrc/autograd/FunctionsManual.cpp, torch 2.13:
#   index_backward:                       areAnyTensorSubclassLike({zeros_like_self, grad}) ||
#       areAnyOptionalTensorSubclassLike(indices) ? zeros_like_self.index_put(indices, grad, true)
#       : at::_index_put_impl_(zeros_like_self, indices, grad, true, true)       (x[idx], x[mask])
#   gather_backward (TensorAdvancedIndexing.cpp):  areAnyTensorSubclassLike({index, grad}) ?
#       result.scatter_add(dim, index, grad) : result.scatter_add_(...)  (gather, take_along_dim)
#   cummaxmin_backward (ReduceOps.cpp):    the same with scatter_add          (cummax, cummin)
#   index_select_backward_symint:          isTensorSubclassLike(index) ?
#       new_zeros(...).index_add(dim, index, grad) : new_zeros(...).index_add_(...) (index_select)
#   value_selecting_reduction_backward_symint:  areAnyTensorSubclassLike({grad, indices}) ?
#       grad_in.scatter(dim, indices, grad) : grad_in.scatter_(...)
#       (max/min with dim, sort, msort, topk, kthvalue, median/nanmedian with dim, mode)
#   take_backward:                         isTensorSubclassLike ? zeros_like(self).put(...)
#       : zeros_like(self).put_(indices, grad, true)                          (take)
#   masked_select_backward:                areAnyTensorSubclassLike({grad, mask}) ?
#       result.masked_scatter(mask, grad) : result.masked_scatter_(mask, grad) (masked_select)
# The out-of-place op clones the buffer: one more input-sized tensor while the node runs
# (measured on real tensors under a no-op dispatch mode: x[idx] backward 196,616 B -> 327,688 B,
# gather backward 262,664 B -> 524,808 B at (128, 512) fp32, tests/test_composite.py).
_IN_PLACE_IN_BACKWARD = {
    aten.index_put.default: (aten.index_put_.default, frozenset({"IndexBackward0"})),
    aten.scatter_add.default: (aten.scatter_add_.default,
                               frozenset({"GatherBackward0", "CummaxBackward0", "CumminBackward0"})),
    aten.index_add.default: (aten.index_add_.default, frozenset({"IndexSelectBackward0"})),
    aten.scatter.src: (aten.scatter_.src, frozenset({
        "MaxBackward0", "MinBackward0", "SortBackward0", "TopkBackward0", "KthvalueBackward0",
        "MedianBackward1", "NanmedianBackward1", "ModeBackward0"})),
    aten.put.default: (aten.put_.default, frozenset({"TakeBackward0"})),
    aten.masked_scatter.default: (aten.masked_scatter_.default, frozenset({"MaskedSelectBackward0"})),
}


def _in_place_in_backward(op, in_place, nodes):
    def kernel(*args, **kwargs):
        node = torch._C._current_autograd_node()
        if node is not None and node.name() in nodes:
            return in_place(*args, **kwargs)
        return op(*args, **kwargs)

    kernel.__name__ = f"{op.__name__.replace('.', '_')}_in_backward"
    kernel.__doc__ = (f"``{op}`` inside the backward of {', '.join(sorted(nodes))}: ``{in_place}`` on the "
                      "formula's zero-filled buffer, as real tensors run it (table above); elsewhere the op.")
    return fake_kernel(op, targets=_BOTH)(kernel)


for _op, (_in_place, _nodes) in _IN_PLACE_IN_BACKWARD.items():
    _in_place_in_backward(_op, _in_place, _nodes)


# ============================================================================================
# The recurrent layers' input projection on the CPU: at::linear's bias added in place
# ============================================================================================

# RNN.cpp's ``FullLayer`` on the CPU projects the whole sequence at once, ``inputs_w =
# params.linear_ih(inputs)``, through ``at::linear`` called from C++ (no torch function: the
# ``linear`` entry above never sees it).  A ``batch_first`` input reaches it transposed, (T, b, I)
# and not contiguous, which takes ``output = at::matmul(input, weight.t())`` and then
# ``isTensorSubclassLike(*bias) ? at::add(output, *bias) : output.add_(*bias)``: a fake bias takes
# the out-of-place add, one (T, b, 3H) tensor more than the real run (nn.GRU inference +9 % at
# b = 3, +14 % at b = 17).  While an RNN of the ``.input`` overload runs on the CPU target
# (``run_rnn``), the one add of a 3-D output and a 1-D bias -- the cells' own adds are 2-D -- is
# the in-place one, as for real.
_IN_RNN: list[bool] = []


def run_rnn(func, args, kwargs):
    """``func`` (``_VF.gru`` / ``rnn_tanh`` / ``rnn_relu`` / ``lstm``, ``.input`` overload) with
    ``at::linear``'s bias add taken in place, as real tensors take it (above)."""
    _IN_RNN.append(True)
    try:
        return func(*args, **kwargs)
    finally:
        _IN_RNN.pop()


@fake_kernel(aten.add.Tensor, targets=Target.CPU)
def add_in_rnn(self, other, *, alpha=1):
    """``at::add(output, bias)`` inside an RNN's input projection: ``output.add_(bias)``, as for
    real (``run_rnn``); every other add as it is."""
    if _IN_RNN and alpha == 1 and isinstance(other, torch.Tensor) and other.dim() == 1 and self.dim() == 3:
        return aten.add_.Tensor(self, other)
    return aten.add.Tensor(self, other, alpha=alpha)


# ============================================================================================
# max_pool1d without autograd on the CPU: no indices
# ============================================================================================


def _pool_length(size: int, kernel: int, stride: int, pad: int, dilation: int, ceil: bool) -> int:
    """``pooling_output_shape`` (aten/src/ATen/native/Pool.h)."""
    numerator = size + 2 * pad - dilation * (kernel - 1) - 1 + (stride - 1 if ceil else 0)
    out = numerator // stride + 1
    if ceil and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def _one(v, name: str) -> int:
    v = v if isinstance(v, int) else tuple(v)
    if isinstance(v, tuple):
        if len(v) != 1:
            raise ValueError(name)
        v = v[0]
    return int(v)


@substitute(F.max_pool1d, torch.max_pool1d, targets=Target.CPU)
def max_pool1d(spec, func, args, kwargs):
    """``at::native::max_pool1d`` (aten/src/ATen/native/MaxPooling.cpp): where ``(self.requires_grad()
    && GradMode::is_enabled()) || self._fw_grad(0).defined() || !self.device().is_cpu() ||
    isTensorSubclassLike(self)``, it returns ``get<0>(max_pool1d_with_indices(...))`` (the int64
    indices are allocated and dropped); else ``at::empty`` of the output and the CPU kernel
    ``max_pool1d_impl``, no indices.  A fake input always takes the first branch: inference on
    the CPU target then shows a transient int64 tensor of the output's size that the real run
    does not allocate (measured: 16,384 B real vs 49,152 B at (8, 16, 64) fp32, kernel 2).
    Here, without autograd on the CPU target, the output is allocated alone (``torch.empty``;
    the kernel itself allocates nothing).  ``F.max_pool1d`` calls ``torch.max_pool1d``; the CUDA
    target always takes the first branch, as the real run does.  ``F.max_pool1d`` (and
    ``nn.MaxPool1d``) re-dispatches to the mode as itself, so both functions are entries."""
    names = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
    a = dict(zip(names, args), **kwargs)
    x = a.get("input")
    if a.get("return_indices"):
        return NotImplemented
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or x.is_quantized or x.is_mkldnn:
        return NotImplemented
    if (x.requires_grad and torch.is_grad_enabled()) or forward_ad.unpack_dual(x).tangent is not None:
        return NotImplemented
    length = x.shape[-1]
    if not isinstance(length, int):
        return NotImplemented  # a symbolic length: leave the composite (its indices included)
    try:
        kernel = _one(a["kernel_size"], "kernel_size")
        stride_ = a.get("stride")
        stride = kernel if stride_ is None or (isinstance(stride_, (list, tuple)) and not stride_) else _one(stride_, "stride")
        pad, dilation = _one(a.get("padding", 0), "padding"), _one(a.get("dilation", 1), "dilation")
    except (KeyError, TypeError, ValueError):
        return NotImplemented  # let the composite check (and raise on) the arguments
    if kernel <= 0 or stride <= 0 or dilation <= 0 or pad < 0 or pad > kernel // 2:
        return NotImplemented
    out = _pool_length(length, kernel, stride, pad, dilation, bool(a.get("ceil_mode", False)))
    if out <= 0:
        return NotImplemented
    return torch.empty((*x.shape[:-1], out), dtype=x.dtype, device=x.device)
