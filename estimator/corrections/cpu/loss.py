"""Loss-function corrections (CPU kernels).

The loss kernels of aten/src/ATen/native/Loss.cpp and LossMultiLabelMargin.cpp run as one aten
op in the capture, but allocate temporaries for real: the unreduced loss, ``log_sigmoid``'s
buffer, the fp32 copy a bf16/fp16 ``mean`` sums, wrapped Python numbers.  Each entry writes the
kernel's allocations in order (``_alloc`` / ``_free``, bytes), as the source makes them, and the
``Fix`` follows from that program (``_fix``): every local maximum of the running total, less
what the outputs hold at the end, is a candidate peak on top of "inputs and outputs alive".

The reductions (``apply_loss_reduction``: ``loss.mean()`` / ``loss.sum()``; ``at::mean_out`` /
``sum_out`` into a structured output) are one more program (``_reduction``), shared by every
entry.  ``tests/test_loss_kernels.py`` compares each program with the profiler's allocator
events of the real kernel, to the byte (fp32 and bf16, every reduction, serial and parallel
sizes), and whole training steps with ``validators.cpu.measure_cpu``.

``F.binary_cross_entropy_with_logits``'s backward is a formula of FunctionsManual.cpp that the
capture sees op by op, but on its composite-compliant branch: out-of-place ops where real
tensors run in place (``bce_with_logits_backward_in_place``, below).

Not corrected here, because the capture sees what the real run allocates: the losses that are
CompositeImplicitAutograd (``l1_loss``, ``kl_div``, ``poisson_nll_loss``, ``margin_ranking_loss``,
``cosine_embedding_loss``, ``hinge_embedding_loss``, ``triplet_margin_loss``, ``cross_entropy``;
Python ones: ``multilabel_soft_margin_loss``, ``gaussian_nll_loss``) run their aten ops one by
one; ``nll_loss(2d)`` and ``multi_margin_loss`` (forward and backward), ``mse_loss_backward``,
``smooth_l1_loss_backward``, ``huber_loss_backward`` and ``log_sigmoid_forward`` allocate their
outputs only (measured, every reduction, with and without ``weight``);
``_ctc_loss_backward``'s ``log_beta`` is ``masks.py``'s entry.
"""

from __future__ import annotations

import torch

from estimator.corrections.registry import (
    NO_FIX,
    Fix,
    bind,
    correction,
    fake_kernel,
    is_contiguous,
    nbytes,
    numel,
    parallel_on_cpu,
)
from estimator.vocab.categories import Target
from estimator.vocab.symbolic import as_expr

aten = torch.ops.aten
_NONE, _MEAN = 0, 1  # at::Reduction::None, Mean (Sum = 2)
_HALF = (torch.bfloat16, torch.float16)
_WRAPPED = 8  # a C++ number wrapped into a 0-dim double / int64 tensor (scalar_to_tensor, ScalarOps.h)
_FP32 = 4


def _alloc(n) -> tuple:
    return (n, 1)


def _free(n) -> tuple:
    return (n, -1)


def _fix(steps: list[tuple], kept, output_bytes: dict | None = None) -> Fix:
    """The ``Fix`` of a kernel whose allocations are ``steps`` (``_alloc`` / ``_free``, in order)
    and whose outputs hold ``kept`` bytes when it returns: each local maximum of the running
    total (an allocation followed by a free, or the last step) less ``kept``."""
    running, peaks = 0, []
    for i, (n, sign) in enumerate(steps):
        running = running + sign * n
        if sign > 0 and (i + 1 == len(steps) or steps[i + 1][1] < 0):
            peaks.append(running - kept)
    peaks = list(dict.fromkeys(peaks))
    # A candidate another one is a constant number of bytes above adds nothing.
    scratch = tuple(p for p in peaks if not any(q != p and _constant_at_least(q - p) for q in peaks))
    scratch = tuple(p for p in scratch if not _constant_at_least(-p))  # never above the outputs
    return Fix(output_bytes=output_bytes or {}, scratch=scratch)


def _constant_at_least(x) -> bool:
    """``x`` is a plain number >= 0 (a sympy expression in ``b`` is not)."""
    try:
        return float(x) >= 0
    except TypeError:
        return False


def _wrapped(dtype: torch.dtype, is_float: bool) -> list[tuple]:
    """A C++ number passed as a Scalar to ``add_`` / ``mul_`` / ``div_`` / ``sub``:
    ``wrapped_scalar_tensor`` (8 B, double for a float, int64 for an integer), copied by
    TensorIterator to the tensor's dtype unless it is that dtype already."""
    copy = 0 if (dtype == torch.float64 if is_float else dtype == torch.int64) else dtype.itemsize
    steps = [_alloc(_WRAPPED)]
    if copy:
        steps += [_alloc(copy), _free(copy)]
    return steps + [_free(_WRAPPED)]


def _reduction(loss: torch.Tensor, dtype: torch.dtype, reduction: int, into: bool = False) -> list[tuple]:
    """``apply_loss_reduction(loss, reduction)`` (Loss.cpp: ``loss.mean()`` / ``loss.sum()``, a new
    one-element tensor), or with ``into`` the structured kernels' ``at::mean_out`` / ``sum_out``
    into their existing output.  ``loss``: the unreduced tensor (its element count; dtype
    ``dtype``).  The new result is not freed here (the caller's program frees or keeps it).

    - ``sum`` (ReduceOps.cpp ``sum_out`` -> ``parallel_reduce``, TensorIteratorReduce.cpp): at
      ``GRAIN_SIZE`` (32,768) elements or more on several threads, ``two_pass_reduction``
      books ``buffer = at::empty({max_threads}, dst.options())``;
    - ``mean`` (``TORCH_IMPL_FUNC(mean_out)``, CPU branch): ``at::sum_out(...)`` then
      ``.div_(dim_prod)`` (an int64 wrapped and copied to the result's dtype); for bf16/fp16,
      "cast_fp32 -> sum -> div -> cast": ``result.to(kFloat)`` (4 B), the input's fp32 copy
      (4 B an element) for ``sum_out``, freed once summed, and the fp32 result freed at the end.

    The two-pass buffer depends on the element count: ``parallel_on_cpu`` asks it, a guard on
    ``b`` (the formula holds on the capture's side of 32,768 elements), except where the buffer
    cannot change the peak."""
    if reduction == _NONE:
        return []
    half = reduction == _MEAN and dtype in _HALF
    acc = torch.float32 if half else dtype
    divide = _wrapped(acc, is_float=False) if reduction == _MEAN else []
    buffer = torch.get_num_threads() * acc.itemsize
    # Where the buffer is no larger than div_'s wrapped number (fp32 / fp64 mean on up to 3 / 2
    # threads) it never shows in the peak, and the element count is not asked: a guard on b
    # would cut the formula at 32,768 elements for nothing.
    hidden = bool(divide) and not half and buffer <= sum(n for n, sign in divide if sign > 0)
    parallel = not hidden and parallel_on_cpu(loss.numel())
    two_pass = [_alloc(buffer), _free(buffer)] if parallel else []
    steps = [] if into else [_alloc(dtype.itemsize)]
    if not half:
        return steps + two_pass + divide
    copy = _FP32 * numel(loss)
    return steps + [_alloc(_FP32), _alloc(copy), *two_pass, _free(copy), *divide, _free(_FP32)]


# -- forward ------------------------------------------------------------------------------------
def _structured(func, args, kwargs, out) -> Fix:
    """``mse_loss`` / ``smooth_l1_loss``: ``TORCH_META_FUNC`` builds a binary TensorIterator, so
    the structured output is allocated at the input's size (N B) and resized to a scalar (it
    keeps its storage); with a reduction ``TORCH_IMPL_FUNC(..._out)`` (Loss.cpp) computes the
    unreduced loss into a second N-byte temporary and ``mean_out`` / ``sum_out`` it into the
    output.  Measured (fp32, (32, 4), mean): ``[512, 512, 8, 4, -4, -8, -512]``."""
    a = bind(func, args, kwargs)
    if a["reduction"] == _NONE:
        return NO_FIX
    n = numel(a["self"]) * out.element_size()
    steps = [_alloc(n), _alloc(n), *_reduction(a["self"], out.dtype, a["reduction"], into=True), _free(n)]
    return _fix(steps, n, {0: n - out.element_size()})


@correction(aten.mse_loss.default, targets=Target.CPU)
def mse_loss(args, kwargs, out) -> Fix:
    """``mse_loss`` (Loss.cpp, structured): ``_structured``.  bf16 mean (N = 256 B):
    ``[256, 256, 4, 512, -512, 8, 4, -4, -8, -4, -256]`` (the fp32 copy of ``mean_out``)."""
    return _structured(aten.mse_loss.default, args, kwargs, out)


@correction(aten.smooth_l1_loss.default, targets=Target.CPU)
def smooth_l1_loss(args, kwargs, out) -> Fix:
    """``smooth_l1_loss`` (Loss.cpp, structured): ``_structured``; measured allocations identical
    to ``mse_loss``'s."""
    return _structured(aten.smooth_l1_loss.default, args, kwargs, out)


def _reduced_in_place(func, args, kwargs, out) -> Fix:
    """``binary_cross_entropy_out_cpu`` / ``soft_margin_loss_out`` (Loss.cpp) write the unreduced
    loss into the output (N B) and, with a reduction, ``loss_reduced = apply_loss_reduction(loss)``,
    ``loss.resize_as_(loss_reduced).copy_(loss_reduced)``: the scalar keeps the N-byte storage and
    the one-element ``loss_reduced`` dies with the op."""
    a = bind(func, args, kwargs)
    if a["reduction"] == _NONE:
        return NO_FIX
    n = numel(a["self"]) * out.element_size()
    reduced = _reduction(a["self"], out.dtype, a["reduction"])
    return _fix([_alloc(n), *reduced, _free(out.element_size())], n, {0: n - out.element_size()})


@correction(aten.binary_cross_entropy.default, targets=Target.CPU)
def binary_cross_entropy(args, kwargs, out) -> Fix:
    """``binary_cross_entropy_cpu`` (Loss.cpp): ``_reduced_in_place`` (``loss.mul_(weight)`` in
    place).  Measured (fp32, (32, 4), mean): ``[512, 4, 8, 4, -4, -8, -4]``."""
    return _reduced_in_place(aten.binary_cross_entropy.default, args, kwargs, out)


@correction(aten.soft_margin_loss.default, targets=Target.CPU)
def soft_margin_loss(args, kwargs, out) -> Fix:
    """``soft_margin_loss`` (Loss.cpp): ``output = at::empty({0})``, ``neg_out(output, input)``
    (resized to N B), in-place ops, then ``_reduced_in_place``; measured as
    ``binary_cross_entropy``."""
    return _reduced_in_place(aten.soft_margin_loss.default, args, kwargs, out)


@correction(aten.huber_loss.default, targets=Target.CPU)
def huber_loss(args, kwargs, out) -> Fix:
    """``huber_loss`` (Loss.cpp): ``loss = at::empty_like(input)`` (N B), one kernel,
    ``apply_loss_reduction(loss)``: a fresh scalar (the output) while ``loss`` is alive.
    Measured (fp32, (32, 4), mean): ``[512, 4, 8, 4, -4, -8, -512]``."""
    a = bind(aten.huber_loss.default, args, kwargs)
    if a["reduction"] == _NONE:
        return NO_FIX
    n = numel(a["self"]) * out.element_size()
    steps = [_alloc(n), *_reduction(a["self"], out.dtype, a["reduction"]), _free(n)]
    return _fix(steps, out.element_size())


def bce_with_logits_steps(input, target, weight, pos_weight, reduction: int) -> list[tuple]:
    """The allocations of ``binary_cross_entropy_with_logits`` (Loss.cpp, CompositeExplicitAutograd,
    torch 2.13), in order::

        auto log_sigmoid_input = at::log_sigmoid(input);
        if (pos_weight) {
            auto log_weight = (*pos_weight_opt - 1).mul(target).add_(1);
            log_sigmoid_input.mul_(log_weight);
        }
        Tensor loss = (1 - target).mul_(input).sub_(log_sigmoid_input);
        if (weight) loss.mul_(*weight_opt);
        return apply_loss_reduction(loss, reduction);

    - ``at::log_sigmoid`` -> ``log_sigmoid_forward`` (Activation.cpp ``log_sigmoid_forward_cpu``):
      its output and an input-sized ``buffer`` (freed: ``log_sigmoid`` returns the output only),
      both ``empty_like(input, Contiguous)``, and the kernel reads ``input.contiguous()``
      (``_contiguous``);
    - ``pos_weight - 1`` (``sub.Scalar``: the int 1 wrapped, 8 B, and copied to the dtype) into a
      pos_weight-sized tensor, ``.mul(target)`` a target-sized one, ``.add_(1)`` another wrapped
      int; the first dies at the ``;``, ``log_weight`` at the end of the block;
    - ``1 - target``: ``operator-(Scalar, Tensor)`` (ATen/TensorOperators.h) is
      ``at::empty_like(target).fill_(1).sub_(target)``: a target-sized tensor, no wrapped number;
      then in-place ops (``weight`` too);
    - ``apply_loss_reduction`` (``_reduction``), then ``log_sigmoid_input`` and (reduced) ``loss``
      are freed.

    Measured (fp32, (32, 4), mean): ``[512, 512, -512, 512, 4, 8, 4, -4, -8, -512, -512]``; with
    ``pos_weight`` (4,): ``[512, 512, -512, 8, 4, 16, -4, -8, 512, 8, 4, -4, -8, -16, -512, 512,
    4, 8, 4, -4, -8, -512, -512]``; bf16 mean: ``[256, 256, -256, 256, 2, 4, 512, -512, 8, 4, -4,
    -8, -4, -256, -256]`` (``mean``'s fp32 copy)."""
    n_in = numel(input) * input.element_size()
    n_loss = numel(target) * target.element_size()
    steps = [_alloc(n_in), _alloc(n_in), *_contiguous(input), _free(n_in)]
    if pos_weight is not None:
        p = numel(pos_weight) * pos_weight.element_size()
        weight_dtype = torch.promote_types(pos_weight.dtype, target.dtype)
        log_weight = numel(target) * weight_dtype.itemsize
        steps += _with_number(_wrapped(pos_weight.dtype, is_float=False), _alloc(p))
        steps += [_alloc(log_weight), *_wrapped(weight_dtype, is_float=False), _free(p), _free(log_weight)]
    steps.append(_alloc(n_loss))
    steps += _reduction(target, target.dtype, reduction)
    steps.append(_free(n_in))
    if reduction != _NONE:
        steps.append(_free(n_loss))
    return steps


# copy_same_type_transpose_ (aten/src/ATen/native/Copy.cpp): a contiguous copy of a transposed 2-D
# tensor of at least 60 x 60 elements goes through one BLOCK_SZ x BLOCK_SZ block of the dtype.
_BLOCK_SZ = 60


def _contiguous(t: torch.Tensor) -> list[tuple]:
    """``t.contiguous()`` while a kernel runs: nothing for a contiguous ``t``, else a copy (freed
    with the kernel's other temporaries: listed first, freed last), plus ``copy_transpose_valid``'s
    block buffer for a transposed 2-D ``t`` (a guard on the element count, as
    ``parallel_on_cpu``)."""
    if is_contiguous(t):
        return []
    n = numel(t) * t.element_size()
    steps = [_alloc(n)]
    transposed = t.dim() == 2 and as_expr(t.stride(0)) == 1 and as_expr(t.stride(1)) == as_expr(t.shape[0])
    if transposed and bool(t.numel() >= _BLOCK_SZ * _BLOCK_SZ):
        block = _BLOCK_SZ * _BLOCK_SZ * t.element_size()
        steps += [_alloc(block), _free(block)]
    return steps + [_free(n)]


def _with_number(wrapped: list[tuple], output: tuple) -> list[tuple]:
    """A binary op with a wrapped number: the number and its dtype copy, then the output, then
    the two freed (TensorIterator keeps its operands until it is destroyed)."""
    allocs = [s for s in wrapped if s[1] > 0]
    return [*allocs, output, *[_free(n) for n, _ in reversed(allocs)]]


@correction(aten.binary_cross_entropy_with_logits.default, targets=Target.CPU)
def binary_cross_entropy_with_logits(args, kwargs, out) -> Fix:
    """``binary_cross_entropy_with_logits`` (Loss.cpp): one op in the capture (its fake kernel
    shows the output only), two input-sized tensors alive inside (``bce_with_logits_steps``): at
    b = 32 a GAN discriminator's (32, 1) logits took 2 x 128 + 12 B more than predicted."""
    a = bind(aten.binary_cross_entropy_with_logits.default, args, kwargs)
    steps = bce_with_logits_steps(a["self"], a["target"], a["weight"], a["pos_weight"], a["reduction"])
    return _fix(steps, nbytes(out))


@correction(aten.multilabel_margin_loss_forward.default, targets=Target.CPU)
def multilabel_margin_loss_forward(args, kwargs, out) -> Fix:
    """``multilabel_margin_loss_forward_out_cpu_template`` (LossMultiLabelMargin.cpp): after
    resizing its two outputs, ``target.min().item<int64_t>()`` and ``target.max()...`` (a 0-dim
    int64 each, freed in turn), then ``input.contiguous()`` / ``target.contiguous()`` (copies when
    strided).  Measured (fp32, (32, 5)): ``[128, 640, 8, -8, 8, -8]``."""
    a = bind(aten.multilabel_margin_loss_forward.default, args, kwargs)
    copies = [_alloc(nbytes(t)) for t in (a["self"], a["target"]) if not is_contiguous(t)]
    steps = [_alloc(_WRAPPED), _free(_WRAPPED), _alloc(_WRAPPED), _free(_WRAPPED), *copies]
    return _fix(steps, 0)


# -- backward -----------------------------------------------------------------------------------
@correction(aten.binary_cross_entropy_backward.default, targets=Target.CPU)
def binary_cross_entropy_backward(args, kwargs, out) -> Fix:
    """``binary_cross_entropy_backward_out_cpu`` (Loss.cpp): the kernel into ``grad_input``,
    ``grad_input.mul_(weight)`` in place, and for 'mean' ``grad_input.div_(input.numel())``: an
    int64 wrapped (8 B) and copied to the dtype.  Measured (fp32): ``[512, 8, 4, -4, -8]``."""
    a = bind(aten.binary_cross_entropy_backward.default, args, kwargs)
    if a["reduction"] != _MEAN:
        return NO_FIX
    return _fix(_wrapped(out.dtype, is_float=False), 0)


@correction(aten.soft_margin_loss_backward.default, targets=Target.CPU)
def soft_margin_loss_backward(args, kwargs, out) -> Fix:
    """``soft_margin_loss_backward_out`` (Loss.cpp)::

        auto z = at::exp(-target * input);
        at::mul_out(grad_input, target, z).mul_(-norm);
        z.add_(1);
        grad_input.div_(z).mul_(grad_output);

    ``-target``, the product and ``z`` (three input-sized tensors, the first two freed at the
    ``;``), ``grad_input`` resized to N B, ``mul_(-norm)`` (a double wrapped), ``add_(1)`` (an int
    wrapped); every reduction alike.  Measured (fp32, (32, 4)): ``[512, 512, 512, -512, -512,
    512, 8, 4, -4, -8, 8, 4, -4, -8, -512]``: 2N above the output, before it exists."""
    a = bind(aten.soft_margin_loss_backward.default, args, kwargs)
    target = a["target"]
    n_target = numel(target) * target.element_size()
    n = nbytes(out)
    steps = [_alloc(n_target), _alloc(n), _alloc(n), _free(n_target), _free(n), _alloc(n),
             *_wrapped(out.dtype, is_float=True), *_wrapped(out.dtype, is_float=False), _free(n)]
    return _fix(steps, n)


@correction(aten.multilabel_margin_loss_backward.default, targets=Target.CPU)
def multilabel_margin_loss_backward(args, kwargs, out) -> Fix:
    """``multilabel_margin_loss_backward_out_cpu_template`` (LossMultiLabelMargin.cpp): into the
    zeroed ``grad_input``, ``target.min()`` / ``max()`` (0-dim int64, freed in turn), the
    ``contiguous()`` copies of strided ``input`` / ``target``, then ``is_target.min()`` /
    ``max()`` (0-dim, the input's dtype).  Measured (fp32, (32, 5)): ``[640, 8, -8, 8, -8, 4, -4,
    4, -4]``."""
    a = bind(aten.multilabel_margin_loss_backward.default, args, kwargs)
    item = out.element_size()
    copies = [nbytes(t) for t in (a["self"], a["target"]) if not is_contiguous(t)]
    steps = [_alloc(_WRAPPED), _free(_WRAPPED), _alloc(_WRAPPED), _free(_WRAPPED), *map(_alloc, copies),
             _alloc(item), _free(item), _alloc(item), _free(item)]
    return _fix(steps, 0)


# ``binary_cross_entropy_with_logits_backward`` (torch/csrc/autograd/FunctionsManual.cpp, torch 2.13):
#   t = pos_weight->mul(target);                                        (both branches)
#   grad_input = areAnyTensorSubclassLike({input, target}) || GradMode::is_enabled()
#       ? t.add(1).sub(target).mul(input.sigmoid()).sub(t)    : t.add(1).sub_(target).mul_(input.sigmoid()).sub_(t)
#       / input.sigmoid().sub(target)                         : input.sigmoid().sub_(target);
#   isTensorSubclassLike(grad) || GradMode ? grad_input = grad_input.mul(grad) : grad_input.mul_(grad);
#   the same for weight; 'mean': grad_input.div_(input.sym_numel()).
# Fake tensors (and any tensor under the capture's dispatch mode) take the out-of-place chain:
# measured under a no-op dispatch mode, (32, 4) fp32: 2 input-sized tensors at once where real
# tensors hold 1 (without pos_weight), 6 where they hold 3 (with it).
_BCE_LOGITS_NODE = "BinaryCrossEntropyWithLogitsBackward0"
_FIRST_MUL = "fxmem_pos_weight_mul"  # node metadata: the graph task whose pos_weight->mul(target) ran


def _in_bce_with_logits_backward(op, in_place):
    def kernel(*args, **kwargs):
        if torch.is_grad_enabled():  # first: the cheapest test, and the forward's every sub and mul
            return op(*args, **kwargs)
        node = torch._C._current_autograd_node()
        if node is None or node.name() != _BCE_LOGITS_NODE:
            return op(*args, **kwargs)
        if op is aten.mul.Tensor and node._saved_pos_weight is not None:
            # The formula's first mul, once per run of the node (one per graph task), is
            # pos_weight->mul(target).  (The saved pos_weight is not the fake tensor the formula
            # gets when it was a constant the capture made fake: identity cannot tell it.)
            task = torch._C._current_graph_task_id()
            if node.metadata.get(_FIRST_MUL) != task:
                node.metadata[_FIRST_MUL] = task
                return op(*args, **kwargs)
        return in_place(*args, **kwargs)

    kernel.__name__ = f"{op.__name__.replace('.', '_')}_in_bce_with_logits_backward"
    kernel.__doc__ = (f"``{op}`` inside ``{_BCE_LOGITS_NODE}`` without grad mode: ``{in_place}`` on the "
                      "formula's own tensor, as real tensors run it (the table above), except "
                      "``pos_weight->mul(target)``, out of place for real too; elsewhere the op.")
    return fake_kernel(op, targets=Target.CPU)(kernel)


bce_with_logits_backward_in_place = {
    op: _in_bce_with_logits_backward(op, in_place)
    for op, in_place in ((aten.sub.Tensor, aten.sub_.Tensor), (aten.mul.Tensor, aten.mul_.Tensor))
}
