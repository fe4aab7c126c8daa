"""Per-op knowledge: memory the fake run does not see, or sees wrongly, per target device.

The capture runs the step on fake CPU tensors.  What the real kernels of a target do
differently lives here, in one registry, with these kinds of entries (and ``@measured``, below):

- ``@correction(op, targets=...)``: a ``Fix`` for one aten op's memory (below);
- ``@substitute(fn, targets=...)``: a torch function replaced while capturing for a target,
  where the target runs other aten ops than the CPU (``F.scaled_dot_product_attention`` picks
  a CUDA backend, ``F.dropout`` a fused kernel with a bool mask);
- ``@optimizer_rule(targets=...)``: what a target changes in a built optimizer (CUDA: the
  foreach implementation by default);
- ``@host_state(targets=...)``: optimizer state the target keeps in host memory (CUDA: the
  ``step`` counters of non-capturable, non-fused optimizers), not counted on the device;
- ``@model_rule(targets=...)``: what a target changes in the model's fake copy before the step
  (a library's host-specific choice made when the model was built: bitsandbytes' CPU repacking
  of 4-bit weights, off for the CUDA target);
- ``@while_capturing(targets=...)``: a context entered around the step (and the probe's real run)
  while capturing for a target, where a library branches on the tensors' device type in a
  function of its own (bitsandbytes' ``matmul``: the CPU's 8-bit training path, a CUDA tensor's
  other), so that the fake CPU tensors take the target's branch;
- ``@managed_state(targets=...)``: optimizer state the target keeps in CUDA managed memory,
  outside the caching allocator (bitsandbytes' paged optimizers): its own figure, in the
  device's memory but not in the allocator's;
- ``@fake_kernel(op, targets=...)``: run instead of an op's fake kernel where that kernel
  specializes a symbolic size that the real kernel does not depend on (same outputs, same
  allocations; the tracker records the op as one);
- ``fast_path(fn, targets=...)``: Python functions of torch (the ``nn.MultiheadAttention`` /
  ``nn.TransformerEncoder(Layer)`` forwards) whose fast-path check
  ``torch.overrides.has_torch_function(tensor_args)`` must answer for the capture's fake tensors
  what it answers for the real ones (``fast_path_checks``, below);
- ``foreach_support(fn, targets=...)``: Python functions of torch whose foreach check
  ``_has_foreach_support(tensors, device)`` (a plain-tensor type test) must answer for the
  capture's fake tensors what it answers for the real ones (``clip_grad_norm_`` and friends).

A second registration of the same (target, op) raises (``withdraw`` removes one: only for a
user's own declarations, ``estimator.register_op``, which are entries of this registry too).
Each entry cites where its number comes from (a PyTorch source file and/or a measurement
command).  A correction function receives the op's arguments and outputs (fake tensors, shapes
possibly symbolic) and returns a ``Fix``:

- ``output_bytes[i]``: bytes the real kernel's i-th tensor output holds beyond what the meta
  kernel reports (it lives and dies with that output's storage);
- ``scratch``: kernel-internal memory alive only while the op runs, as the extra bytes at
  each local maximum inside the kernel, relative to "inputs and outputs alive".  Several
  values because which one is largest can depend on ``b``; each becomes a candidate peak.
- ``outputs``: replacement outputs, for a fake kernel whose outputs alias where the real
  kernel's do not (the aliasing changes what autograd copies); None keeps them.
- ``measure``: the op's memory is measured on this host instead (``@measured``, below).

``@measured(op, targets=...)`` marks ops whose memory depends on the host: which kernel runs
and what scratch it books (oneDNN picks a convolution implementation per CPU ISA, cache size
and thread count).  Their calls are run once for real on the host at a few batch sizes, alone,
and the CPU allocator's events give the exact ``output_bytes`` and ``scratch``
(``estimator.corrections.cpu.host``); nothing is fitted on one machine.

A correction that depends on the GPU (SM count, architecture) takes a fourth parameter
``spec``: the capture's ``TargetSpec``.

Values are ints or sympy expressions: convert shapes with ``estimator.capture.tracker.as_expr``
and compute with sympy, never with SymInts (the arithmetic would be traced, and a Python
comparison would add a shape guard).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _foreach_utils

from estimator.corrections.patches import patched_all
from estimator.vocab.categories import Target
from estimator.vocab.symbolic import as_expr

aten = torch.ops.aten


@dataclass(frozen=True)
class Fix:
    output_bytes: dict[int, Any] = field(default_factory=dict)
    scratch: tuple[Any, ...] = ()
    outputs: Any = None
    measure: bool = False
    measure_with_grad: bool = False  # measured with GradMode on (the kernel reads it: ``measured(grad_mode=)``)
    saved_scalars: int = 0  # wrapped Python numbers (8 B each) autograd keeps for backward (CPU)


NO_FIX = Fix()
MEASURE = Fix(measure=True)
MEASURE_IN_GRAD_MODE = Fix(measure=True, measure_with_grad=True)
CorrectionFn = Callable[..., Fix]
# fn(target_spec, func, args, kwargs) -> the function's result, or NotImplemented to run func.
SubstituteFn = Callable[..., Any]
OptimizerRule = Callable[[Any, torch.optim.Optimizer], None]
_REGISTRY: dict[tuple[Target, Any], CorrectionFn] = {}
_SUBSTITUTES: dict[tuple[Target, Any], SubstituteFn] = {}
_OPTIMIZER_RULES: dict[Target, list[OptimizerRule]] = {}
# rule(optimizer, group, key, value) -> True when that state tensor lives in host memory.
HostRule = Callable[[torch.optim.Optimizer, dict, str, torch.Tensor], bool]
_HOST_RULES: dict[Target, list[HostRule]] = {}
_MANAGED_RULES: dict[Target, list[HostRule]] = {}
_MODEL_RULES: dict[Target, list[Callable[[Any, nn.Module], None]]] = {}
_FAKE_KERNELS: dict[tuple[Target, Any], Callable[..., Any]] = {}
_CONTEXTS: dict[Target, list[Callable[[Any], contextlib.AbstractContextManager]]] = {}


def _targets(targets: Iterable[Target]) -> tuple[Target, ...]:
    targets = tuple(Target(t) for t in ([targets] if isinstance(targets, (str, Target)) else targets))
    if not targets:
        raise ValueError("an entry needs at least one target")
    return targets


def correction(*ops, targets: Iterable[Target]) -> Callable[[CorrectionFn], CorrectionFn]:
    """Register ``fn(args, kwargs, out) -> Fix`` for each aten overload (or packet) in ``ops``
    on each of ``targets``."""

    def register(fn: CorrectionFn) -> CorrectionFn:
        for target in _targets(targets):
            for op in ops:
                overloads = [getattr(op, name) for name in op.overloads()] if hasattr(op, "overloads") else [op]
                for overload in overloads:
                    if (target, overload) in _REGISTRY:
                        raise ValueError(f"a {target.value} correction for {overload} is already registered")
                    _REGISTRY[target, overload] = fn
        return fn

    return register


def measured(*ops, targets: Iterable[Target], grad_mode: bool = False
             ) -> Callable[[Callable[..., bool]], Callable[..., bool]]:
    """Register ``applies(args, kwargs, out) -> bool`` for each op in ``ops``: where it returns
    True, the call's memory is measured on the host (``Fix(measure=True)``); else nothing is
    corrected.  One entry per (target, op), like ``@correction``.  ``grad_mode``: the kernel
    itself reads ``at::GradMode::is_enabled()`` (oneDNN's LSTM keeps a workspace for backward
    only then), so the call is measured in the grad mode the step ran it in (else under
    ``no_grad``)."""

    def register(applies: Callable[..., bool]) -> Callable[..., bool]:
        def fix(args, kwargs, out) -> Fix:
            if not applies(args, kwargs, out):
                return NO_FIX
            return MEASURE_IN_GRAD_MODE if grad_mode and torch.is_grad_enabled() else MEASURE

        fix.__doc__, fix.__name__ = applies.__doc__, applies.__name__
        correction(*ops, targets=targets)(fix)
        return applies

    return register


def substitute(*fns, targets: Iterable[Target]) -> Callable[[SubstituteFn], SubstituteFn]:
    """Register ``sub(target_spec, func, args, kwargs)`` to run instead of the torch function(s)
    ``fns`` while capturing for ``targets`` (through a ``TorchFunctionMode``)."""

    def register(sub: SubstituteFn) -> SubstituteFn:
        for target in _targets(targets):
            for fn in fns:
                if (target, fn) in _SUBSTITUTES:
                    raise ValueError(f"a {target.value} substitute for {fn} is already registered")
                _SUBSTITUTES[target, fn] = sub
        return sub

    return register


def _appending(table: dict, targets: Iterable[Target]) -> Callable:
    """A decorator that appends its function to ``table[target]`` for each of ``targets``."""

    def register(rule):
        for target in _targets(targets):
            table.setdefault(target, []).append(rule)
        return rule

    return register


def optimizer_rule(*, targets: Iterable[Target]) -> Callable[[OptimizerRule], OptimizerRule]:
    """Register ``rule(target_spec, optimizer)``, applied to the optimizer once it is built."""
    return _appending(_OPTIMIZER_RULES, targets)


def host_state(*, targets: Iterable[Target]) -> Callable[[HostRule], HostRule]:
    """Register ``rule(optimizer, group, key, value) -> bool``: state kept in host memory."""
    return _appending(_HOST_RULES, targets)


def on_host(target: Target, optimizer: torch.optim.Optimizer, group: dict, key: str, value: torch.Tensor) -> bool:
    return any(rule(optimizer, group, key, value) for rule in _HOST_RULES.get(target, ()))


def managed_state(*, targets: Iterable[Target]) -> Callable[[HostRule], HostRule]:
    """Register ``rule(optimizer, group, key, value) -> bool``: state kept in managed memory."""
    return _appending(_MANAGED_RULES, targets)


def in_managed_memory(target: Target, optimizer: torch.optim.Optimizer, group: dict, key: str,
                      value: torch.Tensor) -> bool:
    return any(rule(optimizer, group, key, value) for rule in _MANAGED_RULES.get(target, ()))


def fake_kernel(*ops, targets: Iterable[Target]) -> Callable:
    """Register ``kernel(*args, **kwargs)`` to compute ``ops`` on fake tensors instead of their
    fake kernels (a symbolic-friendly equivalent: same outputs, same allocations)."""

    def register(kernel):
        for target in _targets(targets):
            for op in ops:
                if (target, op) in _FAKE_KERNELS:
                    raise ValueError(f"a {target.value} fake kernel for {op} is already registered")
                _FAKE_KERNELS[target, op] = kernel
        return kernel

    return register


_FAST_PATHS: dict[Target, set] = {}  # target -> code objects of the registered functions
_REFUSALS: dict[Target, list[Callable[[], bool]]] = {}  # target -> "the real run refuses" predicates
_CHECKS: list[Target] = []  # the targets of the capture modes entered (innermost last)
_CHECK_PATCHES = contextlib.ExitStack()  # the checks' replacements, from the first entry to the last exit
_HAS_TORCH_FUNCTION = torch.overrides.has_torch_function
_DISABLED = torch._C._disabled_torch_function_impl


def fast_path(*functions, targets: Iterable[Target], refuse: Callable[[], bool] | None = None) -> None:
    """Register Python functions whose fast-path check ``torch.overrides.has_torch_function(
    tensor_args)`` must answer, while capturing for ``targets``, what it answers for the real
    tensors the fake ones stand for.

    The capture runs inside the substitution ``TorchFunctionMode`` (``corrections/mode.py``),
    and ``has_torch_function`` is true for every argument while any such mode is active: the
    forwards of ``nn.MultiheadAttention`` and ``nn.TransformerEncoder(Layer)``
    (torch/nn/modules/activation.py, transformer.py) then refuse their native fast paths, which a
    real run takes.  FakeTensors themselves disable ``__torch_function__``, so for them the
    answer is the one of the real tensors: true only for an argument whose type overrides
    ``__torch_function__`` (``_overrides``; a type marked ``_fxmem_plain_tensor`` stands for a plain
    tensor, such as the capture's nested-tensor stand-in).  Every other condition of those checks
    is evaluated by torch's own code on the fake tensors, as on real ones.  ``refuse()``, where
    given, answers true when the target's real run refuses the fast path for a reason the
    capture cannot show those checks (CUDA autocast, which the capture emulates on the CPU's
    autocast state); the check then answers true, which refuses it the same way."""
    for target in _targets(targets):
        _FAST_PATHS.setdefault(target, set()).update(fn.__code__ for fn in functions)
        if refuse is not None:
            _REFUSALS.setdefault(target, []).append(refuse)


def _overrides(arg) -> bool:
    """``check_has_torch_function`` for one argument, without the torch-function modes."""
    cls = type(arg)
    if cls is torch.Tensor or getattr(cls, "_fxmem_plain_tensor", False):
        return False
    return getattr(cls, "__torch_function__", _DISABLED) is not _DISABLED


def _has_torch_function(args) -> bool:
    """``torch.overrides.has_torch_function`` while a capture's mode is entered: the real run's
    answer inside the registered functions, torch's own everywhere else."""
    if _CHECKS and sys._getframe(1).f_code in _FAST_PATHS.get(_CHECKS[-1], ()):
        return any(_overrides(a) for a in args) or any(refuse() for refuse in _REFUSALS.get(_CHECKS[-1], ()))
    return _HAS_TORCH_FUNCTION(args)


_FOREACH_CHECKS: dict[Target, set] = {}  # target -> code objects of the registered functions
_FOREACH_NAME = "_has_foreach_support"  # the name torch's callers import it under
_HAS_FOREACH_SUPPORT = _foreach_utils._has_foreach_support
_FOREACH_MODULES: list[dict] = []  # the globals of the registered functions' modules


def foreach_support(*functions, targets: Iterable[Target]) -> None:
    """Register Python functions of torch whose foreach check ``_has_foreach_support(tensors,
    device)`` (torch/utils/_foreach_utils.py) must answer, while capturing for ``targets``, what
    it answers for the real tensors the fake ones stand for.

    The check is ``type(t) in _foreach_supported_types`` (``[torch.Tensor]``, plus the subclasses
    that append themselves, DTensor): false for every FakeTensor, so with ``foreach=None`` the
    capture took the per-tensor loops of ``clip_grad_norm_`` / ``clip_grad_value_``
    (torch/nn/utils/clip_grad.py) where real CPU and CUDA gradients take ``_foreach_norm``,
    ``_foreach_mul_`` and ``_foreach_clamp_min_/max_``.  Inside the registered functions a
    FakeTensor is taken for the tensor it stands for: a parameter (``_is_param``) for an
    ``nn.Parameter``, else a plain ``torch.Tensor`` (so is a type marked ``_fxmem_plain_tensor``);
    the device check (``_device_has_foreach_support``: cpu and cuda both pass) and an explicit
    ``foreach=`` are torch's own.  The callers import the function by name, so the name is
    rebound in the registered functions' modules from the capture mode's first entry to its
    last exit (``fast_path_checks_enter``); elsewhere it answers as torch does."""
    for fn in functions:
        code = inspect.unwrap(fn).__code__
        module = inspect.unwrap(fn).__globals__
        if module.get(_FOREACH_NAME) is not _HAS_FOREACH_SUPPORT:
            raise ValueError(f"{fn.__qualname__} does not call torch.utils._foreach_utils.{_FOREACH_NAME}")
        for target in _targets(targets):
            _FOREACH_CHECKS.setdefault(target, set()).add(code)
        if not any(m is module for m in _FOREACH_MODULES):
            _FOREACH_MODULES.append(module)


def _stands_for(t) -> type:
    """The type of the real tensor a capture's tensor stands for."""
    cls = type(t)
    if cls is FakeTensor:
        return nn.Parameter if isinstance(t, nn.Parameter) else torch.Tensor
    return torch.Tensor if getattr(cls, "_fxmem_plain_tensor", False) else cls


def _has_foreach_support(tensors, device) -> bool:
    """``_has_foreach_support`` while a capture's mode is entered: the real tensors' answer
    inside the registered functions, torch's own everywhere else."""
    if _CHECKS and sys._getframe(1).f_code in _FOREACH_CHECKS.get(_CHECKS[-1], ()):
        supported = _foreach_utils._foreach_supported_types
        return _foreach_utils._device_has_foreach_support(device) and all(
            t is None or _stands_for(t) in supported for t in tensors
        )
    return _HAS_FOREACH_SUPPORT(tensors, device)


def fast_path_checks_enter(target: Target) -> None:
    """Called by the capture's substitution mode when it is entered (``mode.Substitutions``):
    from the first entry to the matching exit, ``torch.overrides.has_torch_function`` is
    ``_has_torch_function`` and the foreach checks of ``foreach_support``'s functions are
    ``_has_foreach_support``.  Outside a capture both stay torch's own functions."""
    if not _CHECKS:
        _CHECK_PATCHES.enter_context(patched_all([(torch.overrides, "has_torch_function", _has_torch_function)] + [
            (module, _FOREACH_NAME, _has_foreach_support) for module in _FOREACH_MODULES]))
    _CHECKS.append(Target(target))


def fast_path_checks_exit() -> None:
    if _CHECKS:
        _CHECKS.pop()
    if not _CHECKS:
        _CHECK_PATCHES.close()


def withdraw(op, targets: Iterable[Target]) -> None:
    """Drop the correction and the fake kernel of ``op`` (one overload) on ``targets``: a user's
    declaration (``estimator.register_op``) replaces its own previous one this way."""
    for target in _targets(targets):
        _REGISTRY.pop((target, op), None)
        _FAKE_KERNELS.pop((target, op), None)


def fake_kernel_for(target: Target, func) -> Callable[..., Any] | None:
    return _FAKE_KERNELS.get((target, func))


def substitution(target: Target, func) -> SubstituteFn | None:
    return _SUBSTITUTES.get((target, func))


def has_substitutes(target: Target) -> bool:
    return any(t is target for t, _ in _SUBSTITUTES)


def model_rule(*, targets: Iterable[Target]) -> Callable:
    """Register ``rule(target_spec, model)``, applied to the fake copy of the model."""
    return _appending(_MODEL_RULES, targets)


def while_capturing(*, targets: Iterable[Target]) -> Callable:
    """Register ``context(target_spec)``, a context manager entered around the step and the probe."""
    return _appending(_CONTEXTS, targets)


@contextlib.contextmanager
def capture_contexts(spec):
    """Every ``@while_capturing`` context of ``spec.device`` (a ``TargetSpec``), entered in order."""
    with contextlib.ExitStack() as stack:
        for context in _CONTEXTS.get(spec.device, ()):
            stack.enter_context(context(spec))
        yield


def apply_model_rules(spec, model: nn.Module) -> None:
    for rule in _MODEL_RULES.get(spec.device, ()):
        rule(spec, model)


def apply_optimizer_rules(spec, optimizer: torch.optim.Optimizer | None) -> None:
    """Apply the optimizer rules of ``spec.device`` (a ``TargetSpec``) to ``optimizer``, and to the
    optimizer a wrapper steps (``inner``: ``step.MasterWeights``' optimizer of the fp32 copies,
    which resolves its own defaults such as ``foreach`` from its own groups)."""
    for opt in (optimizer, getattr(optimizer, "inner", None)):
        if opt is not None:
            for rule in _OPTIMIZER_RULES.get(spec.device, ()):
                rule(spec, opt)


def numel(t: torch.Tensor):
    """Elements of ``t`` as an int or a sympy expression (no SymInt arithmetic, no guards)."""
    n = 1
    for size in t.shape:
        n = n * as_expr(size)
    return n


_REDUCED = (torch.bfloat16, torch.float16)


def in_reduced_precision(args, kwargs) -> bool:
    """Whether an op's first tensor argument (``self``, or the first positional one) is bf16/fp16."""
    x = args[0] if args else kwargs.get("self")
    return isinstance(x, torch.Tensor) and x.dtype in _REDUCED


def is_contiguous(t: torch.Tensor) -> bool:
    """Row-major contiguity from the stride expressions (no SymInt comparison, no guard)."""
    return _row_major(t.shape, t.stride())


def is_gemm_ready(t: torch.Tensor) -> bool:
    """``t``'s last two dims row- or column-major and the rest contiguous around them (no guard):
    a matrix BLAS reads as it is."""
    sizes, strides = list(t.shape), list(t.stride())
    if _row_major(sizes, strides):
        return True
    sizes[-2:], strides[-2:] = sizes[:-3:-1], strides[:-3:-1]
    return _row_major(sizes, strides)


def leading_dimension_ok(stride, size) -> bool | None:
    """BLAS's ``stride >= max(1, size)``, decided on the expressions (sizes are positive; no guard),
    None where it cannot be."""
    decided = sympy.Ge(sympy.sympify(stride), sympy.Max(1, sympy.sympify(size)))
    return bool(decided) if decided in (sympy.true, sympy.false) else None


def _row_major(sizes, strides) -> bool:
    expected = 1
    for size, stride in reversed(list(zip(sizes, strides))):
        size, stride = as_expr(size), as_expr(stride)
        if size != 1 and sympy.simplify(sympy.sympify(stride) - expected) != 0:
            return False
        expected = expected * size
    return True


# at::internal::GRAIN_SIZE (aten/src/ATen/Parallel.h): below it, or on one thread, CPU kernels
# run serially.
GRAIN_SIZE = 32768


def parallel_on_cpu(numel) -> bool:
    """``numel >= GRAIN_SIZE && at::get_num_threads() > 1``: whether a CPU kernel that switches
    algorithm at the grain size takes its parallel one.  A symbolic ``numel`` (a SymInt) adds a
    guard on the batch size -- on purpose: the kernel's buffers differ on each side, so the
    formula holds on the requested batch's side only."""
    return torch.get_num_threads() > 1 and bool(numel >= GRAIN_SIZE)


def nbytes(t: torch.Tensor):
    """Bytes of ``t``'s elements (``numel * itemsize``), an int or a sympy expression."""
    return numel(t) * t.element_size()


def bind(func, args, kwargs) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in (no positional magic indexes)."""
    bound = {}
    for i, argument in enumerate(func._schema.arguments):
        if i < len(args):
            bound[argument.name] = args[i]
        else:
            bound[argument.name] = kwargs.get(argument.name, argument.default_value)
    return bound


def _spec(target):
    """``(Target, TargetSpec)`` from either (a bare CUDA target means the default GPU)."""
    from estimator.vocab.target import TargetSpec, target_spec

    if isinstance(target, TargetSpec):
        return target.device, target
    target = Target(target)
    return target, (target_spec(target.value)[0] if target is Target.CUDA else TargetSpec())


def lookup(func, args, kwargs, out, target=Target.CPU) -> Fix:
    """The ``Fix`` of ``func`` on ``target`` (a ``Target``, or the capture's ``TargetSpec``)."""
    target, spec = _spec(target)
    fn = _REGISTRY.get((target, func))
    if fn is None:
        fix = NO_FIX
    elif fn.__code__.co_argcount == 4:  # (args, kwargs, out, spec): depends on the GPU
        fix = fn(args, kwargs, out, spec)
    else:
        fix = fn(args, kwargs, out)
    # On CUDA a wrapped number stays a CPU scalar (TensorIterator reads it as such) and kernels
    # cast their inputs as they load them: no device memory.  A higher-order operator (a compiled
    # region's run_and_save_rng_state) has no schema: the op it runs is its argument.
    if target is not Target.CPU or fix.measure or not isinstance(func, torch._ops.OpOverload):
        return fix
    wrapped, promoted = _wrapped_scalar_bytes(func, args, out), _promoted_input_bytes(func, args)
    if not (wrapped or promoted):
        return fix
    saved = _saved_scalars(func, args) if wrapped else 0
    # Saved ones are outputs of the op (the tracker allocates them), not scratch; in their node's
    # backward the number is that saved tensor, not a new one.
    extra = wrapped - 8 * (saved + _reused_scalar(func, args)) if wrapped else 0
    extra += promoted
    # Alive for the whole op: on top of every in-kernel peak, and a peak of its own.
    scratch = (extra, *(s + extra for s in fix.scratch)) if extra else fix.scratch
    return Fix(fix.output_bytes, scratch, fix.outputs, saved_scalars=saved)


_TENSOR_POSITIONS: dict[Any, tuple[int, ...]] = {}
_WIDE = (torch.float64, torch.int64)  # the dtypes Python numbers are wrapped in
# Binary TensorIterator ops whose ``.Scalar`` kernels wrap the number too (``wrapped_scalar_tensor``
# in BinaryOps.cpp / the comparison ops): e.g. ``div.Scalar`` in MeanBackward.
_WRAPS_SCALAR = frozenset({"add", "sub", "mul", "div", "rsub", "remainder", "fmod", "eq", "ne", "lt", "le", "gt",
                           "ge", "bitwise_and", "bitwise_or", "bitwise_xor"})


def _number_positions(func) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The argument positions where a Python number is wrapped: those whose schema type is Tensor,
    and, for the ``.Scalar`` overloads of ``_WRAPS_SCALAR`` ops, the Scalar ``other``."""
    positions = _TENSOR_POSITIONS.get(func)
    if positions is None:
        arguments = func._schema.arguments
        tensors = tuple(i for i, a in enumerate(arguments) if isinstance(a.type, torch.TensorType))
        wraps = func._overloadpacket.__name__.rstrip("_") in _WRAPS_SCALAR and func._overloadname == "Scalar"
        scalars = tuple(i for i, a in enumerate(arguments) if wraps and a.name == "other")
        positions = _TENSOR_POSITIONS[func] = (tensors, scalars)
    return positions


def _wrapped_scalar_bytes(func, args, out) -> int:
    """The one CPU rule that is not per-op: a Python number passed where the schema says Tensor
    (``aten.div.Tensor(t, 0.5)``), or the Scalar of a binary op's ``.Scalar`` overload
    (``aten.div.Scalar``, ``aten.eq.Scalar``), is wrapped into a 0-dim double/int64 tensor (8 B,
    ``scalar_to_tensor`` in aten/src/ATen/ScalarOps.h) and TensorIterator copies it to the
    computation's dtype (``itemsize`` B unless that is double/int64).  Measured: ``x / 0.5`` on
    fp32 allocates 8 + 4 B besides its output; on bf16 8 + 2; on fp64 8; ``aten.eq.Scalar(x, 0.5)``
    on fp32 8 + 4 (the input's dtype, not the bool result's).
    """
    tensors, scalars = _number_positions(func)
    if not isinstance(out, torch.Tensor):
        return 0
    wrapped = sum(8 + (0 if out.dtype in _WIDE else out.element_size())
                  for i in tensors if i < len(args) and type(args[i]) in (int, float))
    for i in scalars:
        if i < len(args) and type(args[i]) in (int, float) and isinstance(args[0], torch.Tensor):
            dtype = torch.result_type(args[0], args[i])
            wrapped += 8 + (0 if dtype in _WIDE else dtype.itemsize)
    return wrapped


def _promoted_input_bytes(func, args):
    """A binary TensorIterator op (``_WRAPS_SCALAR``, any overload) whose two tensor inputs have
    different dtypes: on the CPU, ``TensorIteratorBase::compute_types``
    (aten/src/ATen/TensorIterator.cpp) copies each input whose dtype is not the common one to it
    (``op.tensor().to(common_dtype_)``, ``promote_inputs_to_common_dtype``), a buffer of that
    input's elements alive during the op, which the meta kernel does not allocate.  E.g. the
    backward of ``scatter_reduce(..., "amax")`` multiplies a bool mask by a float gradient
    (torch/csrc/autograd/FunctionsManual.cpp ``scatter_reduce_backward``): a float copy of the
    mask.  In place, an output of another dtype than the common one is computed into a temporary
    of the common dtype and copied back (``cast_common_dtype_to_outputs``: ``empty_like(output,
    common_dtype_)``): torchao's rowwise float8 ``grad.mul_(scale)``, a bf16 tensor times an fp32
    scale, holds an fp32 copy of it and an fp32 result (measured: 2 x 524,288 B for (256, 512)).
    Python numbers are ``_wrapped_scalar_bytes``'."""
    name = func._overloadpacket.__name__
    if name.rstrip("_") not in _WRAPS_SCALAR or len(args) < 2:
        return 0
    a, b = args[0], args[1]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype == b.dtype:
        return 0
    common = torch.result_type(a, b)
    copies = sum(as_expr(t.numel()) * common.itemsize for t in (a, b) if t.dtype != common)
    in_place = name.endswith("_") and a.dtype != common
    return copies + (as_expr(a.numel()) * common.itemsize if in_place else 0)


# Ops whose backward formula for ``self`` needs ``other`` (tools/autograd/derivatives.yaml:
# ``mul.Tensor``: ``self: mul_tensor_backward(grad, other, self.scalar_type())``; ``div.Tensor``:
# ``self: div_tensor_self_backward(grad, other, self.scalar_type())``): autograd saves it.
_SAVES_OTHER = {aten.mul.Tensor, aten.mul_.Tensor, aten.div.Tensor, aten.div_.Tensor}


def _number_other(func, args) -> bool:
    """``func`` is one of ``_SAVES_OTHER`` and its ``other`` a Python number."""
    return func in _SAVES_OTHER and len(args) >= 2 and type(args[1]) in (int, float)


def _saved_scalars(func, args) -> int:
    """1 when autograd keeps the wrapped number of ``x * 0.5`` / ``x / 2`` for backward: ``other``
    is a Python number, ``self`` requires grad and grad mode is on.  The 0-dim double lives as
    long as the autograd node (measured: ``tanh(0.5 * h)`` ten times keeps 10 x 8 B until
    backward).  The CUDA target keeps it in host memory: not counted there."""
    if not _number_other(func, args):
        return 0
    return int(torch.is_grad_enabled() and isinstance(args[0], torch.Tensor) and args[0].requires_grad)


def _reused_scalar(func, args) -> int:
    """1 in the backward of ``x * 0.5`` / ``x / 2`` (``grad * other``): the wrapped number is the one
    autograd saved (``Tracker`` marks its node), not a new 8 B tensor (only the dtype copy is)."""
    if not _number_other(func, args):
        return 0
    node = torch._C._current_autograd_node()
    return int(node is not None and "fxmem_saved_scalars" in node.metadata)


def registered(target: Target | None = None) -> dict[Any, CorrectionFn]:
    """A copy of the corrections: ``{(target, op overload): fn}``, or ``{op overload: fn}`` for
    one ``target``."""
    if target is None:
        return dict(_REGISTRY)
    return {op: fn for (t, op), fn in _REGISTRY.items() if t is Target(target)}


def substitutes(target: Target | None = None) -> dict[Any, SubstituteFn]:
    """A copy of the substitutes, keyed like ``registered``."""
    if target is None:
        return dict(_SUBSTITUTES)
    return {fn: sub for (t, fn), sub in _SUBSTITUTES.items() if t is Target(target)}
