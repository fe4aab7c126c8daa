"""CUDA target entries: cuDNN RNNs (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``).

Sources: ``aten/src/ATen/native/cudnn/RNN.cpp`` (pytorch/pytorch 357b8267: ``_cudnn_rnn``,
``_cudnn_rnn_backward_input/_weight``, ``_cudnn_impl``, ``try_get_weight_buf``,
``get_dropout_state``), ``aten/src/ATen/native/TensorProperties.cpp`` (newest stored version of
``cudnn_is_acceptable``: cuDNN enabled, ``is_cuda()``, compiled with cuDNN, ``numel() > 0``; the
old dtype test (double/float/half) is gone), ``native_functions.yaml`` / ``derivatives.yaml`` of
the installed torch 2.13, ``torch/_meta_registrations.py`` (``_cudnn_rnn``'s meta) and
``torch/nn/modules/rnn.py``.

On CUDA ``at::lstm/gru/rnn_tanh/rnn_relu`` (RNN.cpp, CompositeImplicitAutograd) take the cuDNN
stub when ``cudnn_is_acceptable(input)``: ``_cudnn_impl`` -> ``at::_cudnn_rnn`` (one op for all
layers and directions) whose autograd node saves input, the weight list, hx, cx, ``result0``
(output), ``result3`` (reserve) and ``result4`` (the weight buffer) and calls
``_cudnn_rnn_backward``.  On CPU the fake run takes ``mkldnn_rnn_layer`` (LSTM) or ordinary
decomposed ops (GRU/RNN), with CPU-only corrections (cpu/rnn.py) that do not apply to CUDA.
So the CUDA target substitutes ``torch._VF.lstm`` & co (what ``nn.RNNBase.forward`` calls) with
``aten._cudnn_rnn`` on the fake tensors: its meta kernel (``_meta_registrations.py``) gives
output, hy, cy and a **0-byte reserve** ("TODO: Query cudnnGetRNNTrainingReserveSize"); the
correction below adds an estimate.  ``_cudnn_rnn_backward`` has no meta kernel: a fake-mode rule
(``_fake_cudnn_rnn_backward``, registered in FakeTensorMode's own table, not the dispatcher)
returns what the CUDA kernel allocates.

Weight buffer: on CUDA ``nn.RNNBase._apply`` -> ``flatten_parameters`` makes the parameters views
into one buffer (``_cudnn_rnn_flatten_weight``), and ``try_get_weight_buf`` finds it: no copy.  The
substitute passes a detached parameter as ``weight_buf`` (an existing storage: nothing allocated,
like the real call) and assumes that flattened layout; its byte count is the sum of the parameters
(cuDNN's weight space, ``cudnnGetRNNWeightSpaceSize``, assumed unpadded: not verifiable here).
Without ``bias`` the flattened buffer also holds zeroed bias slots (``try_get_weight_buf``
expects 2 data pointers per parameter): parameter memory the capture does not see (``NOT_MODELLED``).
"""

from __future__ import annotations

import torch

from estimator.corrections import packed
from estimator.corrections.cuda import Gap
from estimator.corrections.registry import NO_FIX, Fix, bind, correction, nbytes, substitute
from estimator.vocab.categories import Target
from estimator.vocab.symbolic import as_expr

aten = torch.ops.aten

_RNN = ("_cudnn_rnn", "lstm", "gru", "rnn_tanh", "rnn_relu")
NOT_MODELLED: list[Gap] = [
    Gap("cuDNN RNN reserve space: an estimate (cudnnGetRNNTrainingReserveSize is a cuDNN query)", _RNN),
    Gap("cuDNN RNN workspace (cudnnGetRNNTempSpaceSizes), forward and both backward passes", _RNN),
    Gap("cuDNN RNN dropout state (~2 MB per device, cached once: get_dropout_state)", _RNN),
    Gap("RNN weights not flattened into one buffer: a per-call copy of the weights (WEIGHT_FORMAT_WARN)", _RNN),
    Gap("RNN without bias on CUDA: zeroed bias slots in the flattened weight buffer (parameter memory)", _RNN),
    Gap("packed sequences (PackedSequence): RNN.cpp's per-step loop (the CPU's) stands for cuDNN's packed kernel "
        "(one op, its reserve and workspace)", ("pack_padded_sequence",)),
]

# cudnnRNNMode_t (cudnn.h): CUDNN_RNN_RELU 0, CUDNN_RNN_TANH 1, CUDNN_LSTM 2, CUDNN_GRU 3
_MODES = {"lstm": 2, "gru": 3, "rnn_tanh": 1, "rnn_relu": 0}
_GATES = {2: 4, 3: 3, 1: 1, 0: 1}


@substitute(torch._VF.lstm, torch._VF.gru, torch._VF.rnn_tanh, torch._VF.rnn_relu, targets=Target.CUDA)
def cudnn_rnn(spec, func, args, kwargs):
    """``at::lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
    batch_first)`` (and gru/rnn_*: ``hx`` a tensor) -> ``lstm_cudnn`` -> ``_cudnn_impl``: hidden
    size from ``cx`` (``hx`` is the projection size when they differ), ``num_params = 4 or 2
    (+1 with projections)``, ``at::_cudnn_rnn(input, params, num_params, weight_buf, hx, cx,
    mode, hidden_size, proj_size, num_layers, batch_first, dropout, train, bidirectional,
    /*batch_sizes=*/{}, dropout_state)``.  The packed-sequence overloads (``batch_sizes``) run
    RNN.cpp's CPU loop (``packed.rnn``; cuDNN's packed kernel: ``NOT_MODELLED``)."""
    if packed.is_packed(args):  # the .data overload: (data, batch_sizes, hx, params, ...)
        return packed.rnn(func, args, kwargs)
    if kwargs or len(args) != 9 or not isinstance(args[3], bool):
        return NotImplemented
    x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first = args
    if not torch.backends.cudnn.enabled or not isinstance(x, torch.Tensor) or not params:
        return NotImplemented
    if any(isinstance(s, int) and s == 0 for s in x.shape):
        return NotImplemented  # cudnn_is_acceptable: numel() > 0
    mode = _MODES[func.__name__]
    if mode == 2:
        h, c = hx
        hidden = int(c.shape[2])
        proj = int(h.shape[2]) if int(c.shape[2]) != int(h.shape[2]) else 0
    else:
        h, c, hidden, proj = hx, None, int(hx.shape[2]), 0
    num_params = (4 if has_biases else 2) + (1 if proj else 0)
    weight_buf = params[0].detach()  # stands for the flattened buffer: an existing storage
    out = aten._cudnn_rnn.default(
        x, list(params), num_params, weight_buf, h, c, mode, hidden, proj, int(num_layers), bool(batch_first),
        float(dropout), bool(train), bool(bidirectional), [], None,
    )
    return (out[0], out[1], out[2]) if mode == 2 else (out[0], out[1])


def _dims(x: torch.Tensor, batch_first: bool, batch_sizes) -> tuple:
    """(seq_length, mini_batch) as in ``TensorDescriptorListParams::set``."""
    if len(batch_sizes):
        return len(batch_sizes), as_expr(batch_sizes[0])
    T, B = (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])
    return as_expr(T), as_expr(B)


def reserve_estimate(mode: int, T, B, hidden: int, proj: int, num_layers: int, directions: int, dsz: int):
    """ESTIMATE of ``cudnnGetRNNTrainingReserveSize`` / ``cudnnGetRNNTempSpaceSizes``' reserve
    (a cuDNN query; the meta kernel says 0).  The reserve holds what the backward pass reads
    back, per layer, direction and time step: the gate activations (G * H: LSTM 4, GRU 3, RNN 1),
    the layer's output h (H, or the projection size P), the LSTM cell state c (H), and for GRU
    the ``W_hn h + b_hn`` term the reset-gate gradient needs (H)::

        reserve ~= L * D * T * B * dsz * (G*H + H_out + [H for LSTM c] + [H for GRU])

    e.g. LSTM(32, 64), T=16, B=4, fp32: 1*1*16*4*4*(256 + 64 + 64) = 98304 B.  Not measured;
    dropout masks between layers (``dropout > 0``, kept by cuDNN for backward) are not included."""
    per_step = _GATES[mode] * hidden + (proj or hidden) + (hidden if mode in (2, 3) else 0)
    return num_layers * directions * T * B * dsz * per_step


def _input_copy(x: torch.Tensor, batch_first: bool, batch_sizes):
    """``input.transpose(0, 1)`` then ``input.contiguous()`` for ``batch_first``: a copy unless
    the transposed tensor is contiguous (T == 1 or B == 1)."""
    if not batch_first or len(batch_sizes):
        return 0
    T, B = _dims(x, True, batch_sizes)
    if T == 1 or B == 1:
        return 0
    return nbytes(x)


@correction(aten._cudnn_rnn.default, targets=Target.CUDA)
def cudnn_rnn_forward(args, kwargs, out) -> Fix:
    """``_cudnn_rnn`` (RNN.cpp): ``x = input.contiguous()`` (after ``transpose(0, 1)`` for
    ``batch_first``: a copy alive during the op), ``output``/``hy``/``cy`` as the meta kernel,
    ``weight_buf`` reused when defined, then for ``fn_train``: ``workspace`` (freed at the end,
    ``NOT_MODELLED``) and ``reserve = at::empty(reserve_size, kByte)``: returned as result3 and
    saved by autograd.  The reserve gets ``reserve_estimate`` bytes (meta: 0); inference
    (``train=False``): ``empty({0})``."""
    a = bind(aten._cudnn_rnn.default, args, kwargs)
    x = a["input"]
    T, B = _dims(x, a["batch_first"], a["batch_sizes"])
    extra = {}
    if a["train"]:
        directions = 2 if a["bidirectional"] else 1
        extra[3] = reserve_estimate(
            int(a["mode"]), T, B, int(a["hidden_size"]), int(a["proj_size"]), int(a["num_layers"]), directions,
            x.element_size(),
        )
    copy = _input_copy(x, a["batch_first"], a["batch_sizes"])
    return Fix(output_bytes=extra, scratch=(copy,) if copy else ())


def _weight_views(weight_stride0: int, proj_size: int) -> bool:
    """``_cudnn_rnn_backward_weight``: the weight gradients are views into ``dw`` when
    ``grad_params_stride0 == weight_stride0`` (cuDNN's layout has 4 tensors per layer and
    direction, 5 with projections), else fresh tensors filled by ``_copyParams``."""
    return weight_stride0 == (5 if proj_size else 4)


def _flat_elems(a: dict) -> int:
    """Elements of ``dw = at::zeros(weight_buf.sizes())``: the parameters, plus the bias slots
    cuDNN keeps when the module has none (2 * G * H per layer and direction)."""
    n = sum(int(w.numel()) for w in a["weight"])
    if not _weight_views(int(a["weight_stride0"]), int(a["proj_size"])):
        directions = 2 if a["bidirectional"] else 1
        n += int(a["num_layers"]) * directions * 2 * _GATES[int(a["mode"])] * int(a["hidden_size"])
    return n


def _fake_cudnn_rnn_backward(fake_mode, func, *args, **kwargs):
    """What ``_cudnn_rnn_backward`` returns on CUDA: ``dx`` (input's size), ``dhx``, ``dcx``
    (undefined without cx) from ``_cudnn_rnn_backward_input``, and, when ``output_mask[3]``, the
    weight gradients from ``_cudnn_rnn_backward_weight``: views into one flat ``dw`` buffer, or
    fresh per-parameter tensors (``_weight_views``).  All undefined when no gradient is."""
    a = bind(func, args, kwargs)
    weight = a["weight"]
    if a["grad_output"] is None and a["grad_hy"] is None and a["grad_cy"] is None:
        return None, None, None, [None] * len(weight)
    x, hx, cx, mask = a["input"], a["hx"], a["cx"], a["output_mask"]
    with fake_mode:
        dx = x.new_empty(x.shape)
        dhx = hx.new_empty(hx.shape)
        dcx = cx.new_empty(cx.shape) if cx is not None else None
        dw = []
        if mask[3]:
            if _weight_views(int(a["weight_stride0"]), int(a["proj_size"])):
                flat, offset = weight[0].new_empty(_flat_elems(a)), 0
                for w in weight:
                    dw.append(flat[offset:offset + w.numel()].view(w.shape))
                    offset += int(w.numel())
            else:
                dw = [w.new_empty(w.shape) for w in weight]
    return dx, dhx, dcx, dw


def _register_fake_backward() -> None:
    from torch._subclasses import fake_impls

    op = aten._cudnn_rnn_backward.default
    if not fake_impls._is_op_registered_to_fake_rule(op):
        fake_impls.register_op_impl(op)(_fake_cudnn_rnn_backward)


_register_fake_backward()


def _bytes(t: torch.Tensor | None):
    return 0 if t is None else nbytes(t)


@correction(aten._cudnn_rnn_backward.default, targets=Target.CUDA)
def cudnn_rnn_backward(args, kwargs, out) -> Fix:
    """``_cudnn_rnn_backward`` (RNN.cpp): ``zeros_like`` for each undefined incoming gradient
    (output, hy, and cy when cx is defined; usually hy/cy: the loss reads the output only), then
    ``_cudnn_rnn_backward_input``: ``x = input.contiguous()`` and ``dy = grad_output.contiguous()``
    (copies for ``batch_first``), ``dx``, ``dhx``, ``dcx``, workspace (``NOT_MODELLED``); then
    ``_cudnn_rnn_backward_weight``: ``x`` copied again for ``batch_first``, ``dw = zeros(weight_buf)``
    (the outputs' storage, or a scratch buffer when the gradients are copies).

    Scratch relative to inputs + all outputs alive: input phase ``zeros + x + dy - dw`` (the weight
    gradients do not exist yet), weight phase ``zeros + x (+ dw when copied)``."""
    a = bind(aten._cudnn_rnn_backward.default, args, kwargs)
    if a["grad_output"] is None and a["grad_hy"] is None and a["grad_cy"] is None:
        return NO_FIX
    zeros = 0
    if a["grad_output"] is None:
        zeros += _bytes(a["output"])
    if a["grad_hy"] is None:
        zeros += _bytes(a["hx"])
    if a["cx"] is not None and a["grad_cy"] is None:
        zeros += _bytes(a["cx"])
    x_copy = _input_copy(a["input"], a["batch_first"], a["batch_sizes"])
    dy_copy = _input_copy(a["output"], a["batch_first"], a["batch_sizes"])  # grad_output's shape
    dw_out = sum(_bytes(t) for t in out[3]) if a["output_mask"][3] else 0
    if a["output_mask"][3] and not _weight_views(int(a["weight_stride0"]), int(a["proj_size"])):
        weight_phase = zeros + x_copy + _flat_elems(a) * a["weight"][0].element_size()
    else:
        weight_phase = zeros + x_copy
    return Fix(scratch=(zeros + x_copy + dy_copy - dw_out, weight_phase))
