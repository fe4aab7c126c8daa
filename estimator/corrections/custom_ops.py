"""Declare the memory of ops fxmem cannot run or see into: custom and extension ops.

A ``torch.library.custom_op`` without ``register_fake``, or an extension's op (flash-attn,
xformers, bitsandbytes, Liger kernels, apex) without a fake/meta kernel, cannot run on the fake
tensors of the capture; and an op that has a fake kernel still hides what its real kernel
allocates internally.  ``register_op`` says both, per target::

    estimator.register_op(
        "mylib::fused_mlp",
        outputs=lambda x, w: x.new_empty(x.shape[0], w.shape[0]),  # what the op returns
        workspace=lambda x, w: x.shape[0] * w.shape[0] * 4,         # bytes its kernel allocates besides
    )

- ``outputs(*args, **kwargs)`` has the op's signature and returns its results as a fake
  kernel does (``torch.library.register_fake``'s contract: new tensors of the right shapes and
  dtypes, made from the inputs with torch functions; a list is fine for a single result).  It
  replaces the op's own fake kernel, if any, during fxmem's captures only.
- ``workspace(*args, **kwargs)`` returns the bytes the real kernel holds beyond its inputs and
  outputs at its peak (an int, or several ints for several local maxima); it becomes the op's
  kernel scratch, a candidate peak of its own.  Under a symbolic capture the sizes are SymInts:
  compute with them as given (``x.shape[0] * x.shape[1] * 4``, ``x.numel()``); a Python
  comparison (``if``, ``max``) on a size would add a shape guard, which narrows the range of
  ``b`` the formula is said to hold for (``torch.sym_max`` does not).

Both receive every argument of the op, defaults filled in (the dispatcher drops arguments equal
to their defaults).  ``targets`` (default both) says which target's kernels the declaration
describes; declare the op again with other functions for another target.  An op's backward is
whatever its autograd formula runs: plain torch ops need nothing, a backward custom op needs a
declaration of its own.

How it plugs in: each declaration is one entry of the corrections registry per (target,
overload): ``outputs`` a ``@fake_kernel`` (the tracker runs it instead of the op while
capturing), ``workspace`` a ``@correction`` returning ``Fix(scratch=...)``, its values turned
into sympy expressions with ``estimator.vocab.symbolic.as_expr``.  Nothing is registered with
``torch.library``: outside fxmem's captures the op behaves as before.  A declaration may
replace an earlier declaration of the same op (a notebook cell run twice), never an entry fxmem
ships for a built-in op.  The report's notes name the declared ops the step ran.
"""

from __future__ import annotations

import inspect
import operator
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import sympy
import torch

from estimator.corrections import registry
from estimator.vocab.categories import Target
from estimator.vocab.errors import CaptureError, FxmemError, InputError
from estimator.vocab.symbolic import as_expr

__all__ = ["OpDeclaration", "declarations", "register_op", "unregister_op"]


@dataclass(frozen=True)
class OpDeclaration:
    """One ``register_op`` call: the op, its overloads and the functions that give its memory."""

    name: str  # qualified name, "mylib::fused_mlp"
    overloads: tuple[Any, ...]  # torch OpOverloads
    targets: tuple[Target, ...]
    outputs: Callable[..., Any] | None
    workspace: Callable[..., Any] | None

    @property
    def declares(self) -> str:
        """What the declaration gives: "outputs", "workspace" or "outputs and workspace"."""
        return " and ".join(w for w in ("outputs", "workspace") if getattr(self, w) is not None)


_DECLARED: dict[tuple[Target, Any], OpDeclaration] = {}  # (target, overload) -> its declaration
_BY_NAME: dict[tuple[Target, str], OpDeclaration] = {}  # (target, str(overload)) -> the same


def register_op(op, *, outputs: Callable[..., Any] | None = None, workspace: Callable[..., Any] | None = None,
                targets: Iterable[str | Target] | str | Target = ("cpu", "cuda")) -> OpDeclaration:
    """Declare the memory of the operator ``op`` for fxmem's captures (see the module docstring).

    Args:
        op: ``"namespace::name"`` (every overload) or ``"namespace::name.overload"``, a
            ``torch.ops`` packet or overload, or what ``torch.library.custom_op`` returned; the
            op must be defined (import its library first).
        outputs: ``fn(*op_args) -> result``, a fake kernel for the op (new tensors of the
            result's shapes and dtypes, made from the inputs).
        workspace: ``fn(*op_args) -> bytes`` (or a list of bytes, one per local maximum): what
            the real kernel holds besides its inputs and outputs.  At least one of the two.
        targets: "cpu", "cuda" or both (the default).

    Returns:
        The ``OpDeclaration``; a later declaration of the same op and target replaces it.

    Raises ``InputError`` for a function that is not callable or does not take the op's
    arguments, an unknown op or target, or an op fxmem already has an entry for.

        >>> import torch, estimator
        >>> @torch.library.custom_op("doc::twice", mutates_args=())
        ... def twice(x: torch.Tensor) -> torch.Tensor:
        ...     return x * 2
        >>> decl = estimator.register_op("doc::twice", outputs=lambda x: torch.empty_like(x),
        ...                              workspace=lambda x: 0, targets="cpu")
        >>> decl.declares
        'outputs and workspace'
        >>> estimator.unregister_op("doc::twice")
    """
    for what, fn in (("outputs", outputs), ("workspace", workspace)):
        if fn is not None and not callable(fn):
            raise InputError(f"register_op({op!r}): {what} must be a function of the op's arguments, "
                             f"got {type(fn).__name__}")
    if outputs is None and workspace is None:
        raise InputError(f"register_op({op!r}) declares nothing: give outputs= (a fake kernel for the op), "
                         "workspace= (its kernel's scratch bytes), or both")
    target_list = _targets(targets, f"register_op({op!r})")
    name, overloads = _resolve(op)
    for overload in overloads:
        for what, fn in (("outputs", outputs), ("workspace", workspace)):
            if fn is not None:
                _check_signature(name, overload, what, fn)
        for target in target_list:
            shipped = (target, overload) not in _DECLARED and (
                overload in registry.registered(target) or registry.fake_kernel_for(target, overload) is not None)
            if shipped:
                raise InputError(f"fxmem already models {name} on {target.value} (estimator/corrections); "
                                 "a declaration would replace that entry")
    declaration = OpDeclaration(name, overloads, target_list, outputs, workspace)
    for overload in overloads:
        _withdraw(overload, target_list)
        if outputs is not None:
            registry.fake_kernel(overload, targets=target_list)(_kernel(declaration, overload))
        if workspace is not None:
            registry.correction(overload, targets=target_list)(_correction(declaration, overload))
        for target in target_list:
            _DECLARED[target, overload] = declaration
            _BY_NAME[target, str(overload)] = declaration
    return declaration


def unregister_op(op, *, targets: Iterable[str | Target] | str | Target = ("cpu", "cuda")) -> None:
    """Remove the declarations of ``op`` on ``targets`` (those ``register_op`` made; nothing else)."""
    _, overloads = _resolve(op)
    for overload in overloads:
        _withdraw(overload, _targets(targets, f"unregister_op({op!r})"))


def declarations(target: str | Target | None = None) -> dict[tuple[Target, Any], OpDeclaration]:
    """A copy of the declarations in force: ``{(target, overload): declaration}``."""
    wanted = None if target is None else _targets(target, "declarations()")[0]
    return {key: d for key, d in _DECLARED.items() if wanted is None or key[0] is wanted}


def _withdraw(overload, targets: tuple[Target, ...]) -> None:
    for target in targets:
        if _DECLARED.pop((target, overload), None) is not None:
            del _BY_NAME[target, str(overload)]
            registry.withdraw(overload, [target])


def _targets(targets, where: str) -> tuple[Target, ...]:
    given = [targets] if isinstance(targets, (str, Target)) else list(targets)
    valid = ", ".join(repr(t.value) for t in Target)
    out = []
    for t in given:
        try:
            out.append(Target(t))
        except ValueError:
            raise InputError(f"{where}: unknown target {t!r}; targets are {valid}") from None
    if not out:
        raise InputError(f"{where}: targets is empty; give one or more of {valid}")
    return tuple(dict.fromkeys(out))


def _resolve(op) -> tuple[str, tuple[Any, ...]]:
    """The qualified name and the overloads of ``op`` (a name, packet, overload or CustomOpDef)."""
    from torch._library.custom_ops import CustomOpDef

    if isinstance(op, CustomOpDef):
        op = op._opoverload
    if isinstance(op, torch._ops.OpOverload):
        return op.name().split(".")[0], (op,)
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name, tuple(getattr(op, o) for o in op.overloads())
    if not isinstance(op, str):
        raise InputError("register_op: op must be a name like 'mylib::fused_mlp', a torch.ops operator or a "
                         f"torch.library.custom_op, got {type(op).__name__}")
    match = re.fullmatch(r"(\w+)::(\w+)(?:\.(\w+))?", op.strip())
    if match is None:
        raise InputError(f"register_op({op!r}): an op is named 'namespace::name' or 'namespace::name.overload'")
    namespace, name, overload = match.groups()
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        overloads = (getattr(packet, overload),) if overload else tuple(getattr(packet, o) for o in packet.overloads())
    except (AttributeError, RuntimeError):
        raise InputError(f"register_op({op!r}): unknown op: torch has no operator {op.strip()} (import the "
                         "library that defines it before declaring it)") from None
    return f"{namespace}::{name}", overloads


def _check_signature(name: str, overload, what: str, fn) -> None:
    """``fn`` must accept the op's arguments as ``_call`` passes them."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: found out when it is called
    arguments = overload._schema.arguments
    positional = [a.name for a in arguments if not a.kwarg_only]
    keywords = {a.name: a.name for a in arguments if a.kwarg_only}
    try:
        signature.bind(*positional, **keywords)
    except TypeError as exc:
        schema = ", ".join(positional + [f"*, {k}" if i == 0 else k for i, k in enumerate(keywords)])
        raise InputError(f"register_op({name!r}): {what} must take the op's arguments ({schema}): {exc}") from None


def _call(declaration: OpDeclaration, what: str, overload, args, kwargs):
    """Call ``declaration.<what>`` with every argument of the op (defaults filled in)."""
    bound = registry.bind(overload, args, kwargs)
    arguments = overload._schema.arguments
    positional = [bound[a.name] for a in arguments if not a.kwarg_only]
    keywords = {a.name: bound[a.name] for a in arguments if a.kwarg_only}
    try:
        return getattr(declaration, what)(*positional, **keywords)
    except FxmemError:
        raise
    except Exception as exc:
        raise InputError(f"the {what} declared for {declaration.name} (estimator.register_op) raised "
                         f"{type(exc).__name__}: {exc}") from exc


def _kernel(declaration: OpDeclaration, overload) -> Callable[..., Any]:
    """The fake kernel of ``overload``: the declared outputs, in the structure its schema returns
    (a one-element list for a single result is unwrapped; several results become a tuple)."""
    returns = overload._schema.returns
    one = len(returns) == 1 and not isinstance(returns[0].type, torch.ListType)  # "-> Tensor"

    def declared_outputs(*args, **kwargs):
        result = _call(declaration, "outputs", overload, args, kwargs)
        if not returns and result is None:
            return None
        if one and isinstance(result, (list, tuple)) and len(result) == 1:
            result = result[0]
        values = list(result) if isinstance(result, (list, tuple)) and len(returns) > 1 else [result]
        leaves = [x for v in values for x in (v if isinstance(v, (list, tuple)) else [v])]
        shaped = len(values) == len(returns) and all(
            isinstance(v, (list, tuple)) == isinstance(r.type, torch.ListType) for v, r in zip(values, returns))
        if not shaped or not all(x is None or isinstance(x, torch.Tensor) for x in leaves):
            raise InputError(
                f"the outputs declared for {declaration.name} (estimator.register_op) returned "
                f"{_describe(result)}; the op returns {len(returns)} value(s): {returns}")
        devices = {t.device for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)}
        stray = [x.device for x in leaves if x is not None and devices and x.device not in devices]
        if stray:
            raise InputError(
                f"the outputs declared for {declaration.name} (estimator.register_op) are on {stray[0]}, not on "
                "the inputs' device: make them from the inputs (x.new_empty(...), torch.empty_like(x))")
        return tuple(values) if len(returns) > 1 else values[0]

    declared_outputs.__doc__ = f"{declaration.name}: outputs declared with estimator.register_op."
    return declared_outputs


def _describe(value) -> str:
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__


def _correction(declaration: OpDeclaration, overload) -> registry.CorrectionFn:
    """The correction of ``overload``: the declared workspace as the kernel's scratch."""

    def declared_workspace(args, kwargs, out) -> registry.Fix:
        value = _call(declaration, "workspace", overload, args, kwargs)
        return registry.Fix(scratch=_bytes(declaration, value))

    declared_workspace.__doc__ = f"{declaration.name}: workspace declared with estimator.register_op."
    return declared_workspace


def _bytes(declaration: OpDeclaration, value) -> tuple[Any, ...]:
    """The declared workspace as scratch values: ints or sympy expressions (``as_expr``), >= 0."""
    out = []
    for v in value if isinstance(value, (list, tuple)) else (value,):
        expr = _integer(v)
        if expr is None:
            raise InputError(f"the workspace declared for {declaration.name} (estimator.register_op) must give bytes "
                             f"as an int (or a list of ints), got {_describe(value)}")
        if sympy.sympify(expr).is_negative:
            raise InputError(f"the workspace declared for {declaration.name} (estimator.register_op) is negative: "
                             f"{expr}")
        out.append(expr)
    return tuple(out)


def _integer(v):
    """``v`` as an int or a sympy expression (a SymInt's, via ``as_expr``); None if not an integer."""
    if isinstance(v, torch.SymInt):
        return as_expr(v)
    if isinstance(v, sympy.Expr):
        return v if v.is_integer is not False else None
    if isinstance(v, bool):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


# -- the report's notes and the capture's error -----------------------------------------------------

def notes(ops, target: Target) -> tuple[str, ...]:
    """The note naming the declared ops among the captured ``ops`` (``OpEvent``s)."""
    seen: dict[str, OpDeclaration] = {}
    for op in ops:
        declaration = _BY_NAME.get((target, op.name))
        if declaration is not None:
            seen.setdefault(declaration.name, declaration)
    if not seen:
        return ()
    listed = ", ".join(f"{name} ({d.declares})" for name, d in seen.items())
    return (f"memory declared with estimator.register_op, not derived by fxmem: {listed}",)


_BUILTIN = frozenset({"aten", "prim", "prims", "debugprims", "quantized"})  # the concrete fallback may run these
_OP_NAME = re.compile(r"\b(\w+)::(\w+)(?:\.(\w+))?")
_NO_KERNEL = ("fake impl", "abstract impl", "meta kernel", "'meta' backend", "meta tensors")


def undeclared_op(exc: BaseException, where: str | None = None) -> CaptureError | None:
    """A ``CaptureError`` naming the op and the declaration to write, when ``exc`` (or its cause)
    says an op cannot run on fake tensors for want of a fake/meta kernel; None otherwise.

    The messages it reads (torch 2.13): ``FakeTensorMode._dispatch_impl``
    (torch/_subclasses/fake_tensor.py) raises ``UnsupportedOperatorException(func)`` for an op
    without a Meta kernel, since it runs no real kernel for namespaces outside aten/prims
    (``can_run_unsafe_fallback``); a ``torch.library.custom_op`` without ``register_fake`` raises
    "There was no fake impl registered for <CustomOpDef(ns::op)>" (torch/_library/custom_ops.py,
    ``_register_fake_dispatcher_impl``); a meta tensor reaching an op without a Meta kernel gives
    "Could not run 'ns::op' with arguments from the 'Meta' backend".  Called by
    ``estimator.capture.isolation.errors_named``.  Built-in namespaces (aten, prims) are left alone:
    their unsupported ops may run on the concrete fallback.
    """
    from torch._subclasses.fake_tensor import UnsupportedOperatorException

    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        overload = None
        if isinstance(error, UnsupportedOperatorException) and error.args:
            overload = error.args[0] if isinstance(error.args[0], torch._ops.OpOverload) else None
            name = overload.name().split(".")[0] if overload is not None else _name_in(str(error))
        elif any(phrase in str(error).lower() for phrase in _NO_KERNEL):
            name = _name_in(str(error))
        else:
            name = None
        if name is not None and name.split("::")[0] not in _BUILTIN:
            return CaptureError(_message(name, overload, where))
        error = error.__cause__ or error.__context__
    return None


def _name_in(text: str) -> str | None:
    match = _OP_NAME.search(text)
    return None if match is None else f"{match.group(1)}::{match.group(2)}"


def _message(name: str, overload, where: str | None) -> str:
    if overload is None:
        try:
            overload = _resolve(name)[1][0]
        except InputError:
            overload = None
    args = "*args"
    first = "x"
    if overload is not None:
        arguments = overload._schema.arguments
        names = [a.name for a in arguments if not a.kwarg_only]
        keywords = [a.name for a in arguments if a.kwarg_only]
        args = ", ".join(names + (["*", *keywords] if keywords else [])) or "*args"
        tensors = [a.name for a in arguments if isinstance(a.type, torch.TensorType)]
        first = tensors[0] if tensors else first
    example = (f'estimator.register_op("{name}", outputs=lambda {args}: torch.empty_like({first}), '
               f"workspace=lambda {args}: 0)")
    at = f" (at {where})" if where else ""
    return (f"{name} has no fake (meta) kernel, so fxmem cannot run it on fake tensors{at}. Declare its memory "
            f"before estimating, e.g.\n    {example}\nwith outputs returning tensors of the shapes and dtypes "
            f"{name} returns and workspace the bytes its kernel allocates besides them (README: \"Custom and "
            "extension ops\").")
