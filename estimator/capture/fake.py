"""Fake copies of the user's model and sample: same shapes, dtypes and aliasing, no data.

The model is deep-copied with every parameter, buffer and tensor it holds (plain attributes,
lists and dicts of tensors, tensors on helper objects: ``steps.held_tensors``) replaced by a
fake CPU tensor (the user's model is not touched, and nothing of model size is allocated;
models built on the ``meta`` device work the same way).  The batch dimension of every sample
tensor (dim 0 unless ``batch_dims`` says otherwise) becomes the one symbol of the batch size,
or a concrete size for the fallback path.

Hooks the user registered on the model's modules run in the fake run (the tensors a hook keeps
alive are memory of the step), but on the copy: each hook function is copied with the lists,
dicts and sets it reaches through its closure or its module's globals, so nothing fake lands
in the user's objects.

Real tensors the step meets that are neither the model's nor the sample's (a module-level
constant used in ``forward``, a target a ``loss_fn`` closes over) are turned into fake ones
as they are met (``RealTensors``) and counted: in the model's forward as a buffer, elsewhere as
an input -- one whose batch dimension has the sample's batch size follows ``b``.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import os
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch._prims_common import compute_elementwise_output_logical_to_physical_perm as physical_order
from torch._prims_common import is_non_overlapping_and_dense_or_false as dense
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from estimator.capture import compiled, quantized, steps, watchdog
from estimator.capture.tracker import wrapped
from estimator.vocab.categories import Category
from estimator.vocab.errors import CaptureError, InputError

CPU = torch.device("cpu")
aten = torch.ops.aten


# The largest size a real dim can have (int64).  A symbol's range ends here, not at sympy's
# infinity, so that ``x[:, :n]``'s full slice of a symbolic dim is known to be one and dropped,
# as eager drops it for real sizes (``applySlice`` in ATen/TensorIndexing.h returns ``self``
# when ``length <= stop`` is statically known; the slice's ``stop`` is INT64_MAX).  Unbounded,
# the capture recorded a ``slice`` whose backward (``slice_backward``) allocates a zeroed copy
# of the whole gradient: Mamba's selective scan +7.7 % at b = 32.  ``symbols.symbol_range`` reads this
# bound as no bound.
SIZE_MAX = sys.maxsize


def _fake(t: torch.Tensor, mode: FakeTensorMode, symbolic_context=None) -> torch.Tensor:
    """A fake CPU tensor like ``t``: static shape unless ``symbolic_context`` says otherwise."""
    if t.device.type not in ("cpu", "meta"):  # e.g. CUDA: the capture always runs on fake CPU tensors
        t = t.to("meta")
    if symbolic_context is None:
        fake = mode.from_tensor(t, static_shapes=True)
    else:
        fake = mode.from_tensor(t, symbolic_context=symbolic_context)
        for size in fake.shape:
            if isinstance(size, torch.SymInt) and not size.node.expr.is_number:
                mode.shape_env.constrain_symbol_range(size.node.expr, 2, SIZE_MAX)
    if fake.device != CPU:
        with mode:
            fake = fake.to(CPU)
    return fake


def _scalar(t: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    """A fake tensor that knows its value, for a one-element buffer (BatchNorm's
    ``num_batches_tracked``, a temperature): code may read it (``1.0 /
    float(self.num_batches_tracked)`` with ``momentum=None``) without a real run, and memory
    does not depend on it.  The value is a copy (the fake run's ``add_(1)`` must not reach the
    user's buffer); 0 for an integer on the meta device (``_is_scalar``)."""
    value = torch.zeros(t.shape, dtype=t.dtype) if t.device.type != "cpu" else t.detach().clone()
    return mode.fake_tensor_converter.from_real_tensor(mode, value, make_constant=True)


def _is_scalar(t: torch.Tensor) -> bool:
    """A one-element buffer whose value is known: on the CPU, or an integer counter (0 on meta)."""
    if isinstance(t, nn.Parameter) or nn.parameter.is_lazy(t) or t.numel() != 1:
        return False
    return t.device.type == "cpu" or not (t.is_floating_point() or t.is_complex())


def fake_model(model: nn.Module, mode: FakeTensorMode, memo: dict[int, Any] | None = None) -> nn.Module:
    """A deep copy of ``model`` whose tensors are fake CPU tensors (shared tensors stay shared),
    and whose hooks are the user's hooks, copied (``_isolate_hooks``).  ``memo`` (filled): the
    user's objects by id -> their copies (for ``isolated``)."""
    memo = {} if memo is None else memo
    state = steps.state_tensors(model, None, ())
    aliases: dict[tuple, torch.Tensor] = {}  # a meta tensor's place in its storage -> its fake
    for value in [*state[Category.PARAMETER].values(), *state[Category.BUFFER].values()]:
        if id(value) not in memo:
            if isinstance(value, nn.parameter.UninitializedTensorMixin):
                raise InputError(
                    f"{type(value).__name__} {_state_name(state, value)!r}: the model has lazy modules "
                    "(nn.LazyLinear, ...) whose parameters do not exist yet; initialise them with one call on a "
                    "sample first (with torch.no_grad(): model(sample)), then estimate")
            if quantized.unquantized(value):
                raise InputError(
                    f"{type(value).__name__} {_state_name(state, value)!r} is not quantized yet: bitsandbytes "
                    "quantizes a weight when the model moves to its device (model.to('cuda')), which a model on "
                    "the meta device never does; call estimator.integrations.bitsandbytes.quantize(model) first "
                    "(it quantizes on the meta device: sizes without the weights), or move the model")
            place = _meta_place(value)
            if place in aliases:
                fake = aliases[place]
            else:
                fake = _scalar(value, mode) if _is_scalar(value) else _fake(value.detach(), mode)
                if place is not None:
                    aliases[place] = fake
            if isinstance(value, nn.Parameter):
                fake = nn.Parameter(fake, requires_grad=value.requires_grad)
            memo[id(value)] = fake
    try:
        copied = copy.deepcopy(model, memo)
        # A Parameter subclass's Python attributes (bitsandbytes' Params4bit: its quant_state, whose
        # tensors are faked above, and its module, copied above) on the fake parameter that stands for it.
        for value in state[Category.PARAMETER].values():
            if attributes := steps.parameter_attributes(value):
                memo[id(value)].__dict__.update(copy.deepcopy(attributes, memo))
                memo[id(value)].__dict__[steps.COPIED_ATTRIBUTES] = tuple(attributes)
    except Exception as exc:
        raise CaptureError(
            f"could not copy the model ({type(exc).__name__}: {exc}); fxmem deep-copies the module "
            "structure with fake tensors: objects that cannot be deep-copied must not be module attributes"
        ) from exc
    _isolate_hooks(copied, memo)
    return copied


def _meta_place(t: torch.Tensor) -> tuple | None:
    """Where a meta tensor lies in its storage (storage, offset, shape, strides, dtype), or None
    for any other.  Two meta tensors at one place are one tensor (an ``Int8Params`` and its
    ``CB``): one fake for both, as the converter gives real tensors that share a storage one fake
    storage (``_fake`` moves each meta fake to the CPU, a storage of its own).  Meta tensors that
    overlap otherwise stay apart."""
    if t.device.type != "meta":
        return None
    return t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype


def _state_name(state, value) -> str:
    return next((name for tensors in state.values() for name, t in tensors.items() if t is value), "?")


def held_note(model: nn.Module) -> tuple[str, ...]:
    """The report's note on the tensors ``model`` holds besides parameters and buffers."""
    held = steps.held_tensors(model)
    if not held:
        return ()
    listed = [f"{name} {_describe(t)}" for name, t in held.items()]
    return (f"the model holds {len(held)} tensor(s) besides its parameters and buffers, counted as model state "
            f"(buffers), {sum(_nbytes(t) for t in held.values()):,} B in all: {_first(listed)}",)


# -- the user's hooks ----------------------------------------------------------------------
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _isolate_hooks(model: nn.Module, memo: dict[int, Any]) -> None:
    """Replace each hook function of ``model`` (the copy) by a copy of it whose closure cells
    and the globals it names that are containers (lists, dicts, sets, deques) are copies too:
    objects of the copied model map to their copies (``memo``), the user's containers to new
    ones holding the same items.  A hook that appends outputs to a user list appends to the
    copy: the fake run keeps them alive as the real run would, and the user's list is left
    alone."""
    for module in model.modules():
        for attr in _HOOK_DICTS:
            hooks = getattr(module, attr, None)
            if not hooks:
                continue
            for key, hook in list(hooks.items()):
                hooks[key] = isolated(hook, memo)


def isolated(hook, memo: dict[int, Any]):
    """A copy of the function ``hook`` whose closure cells, defaults and the globals it names that
    are containers are copies, the objects in ``memo`` (the model's) mapped to their copies
    (``_containers``); a bound method's object mapped too; a callable object as it is."""
    if isinstance(hook, functools.partial):
        return functools.partial(isolated(hook.func, memo), *_containers(hook.args, memo),
                                 **_containers(hook.keywords, memo))
    if isinstance(hook, types.MethodType):
        return types.MethodType(isolated(hook.__func__, memo), memo.get(id(hook.__self__), hook.__self__))
    if not isinstance(hook, types.FunctionType):
        return hook  # a callable object: deep-copied with the model already
    if id(hook) in memo:
        return memo[id(hook)]
    closure = None
    if hook.__closure__ is not None:
        closure = tuple(_cell(c, memo) for c in hook.__closure__)
    names = _global_names(hook.__code__)
    env = dict(hook.__globals__)
    for name in names & env.keys():
        env[name] = _containers(env[name], memo)
    copied = types.FunctionType(hook.__code__, env, hook.__name__, _containers(hook.__defaults__, memo), closure)
    copied.__kwdefaults__ = _containers(hook.__kwdefaults__, memo)
    copied.__dict__.update(hook.__dict__)
    copied.__qualname__ = hook.__qualname__
    memo[id(hook)] = copied
    return copied


def _cell(cell, memo):
    try:
        contents = cell.cell_contents
    except ValueError:  # an empty cell
        return types.CellType()
    return types.CellType(_containers(contents, memo))


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _containers(value, memo: dict[int, Any]):
    """``value`` with its containers copied (recursively) and the model's objects mapped to their
    copies; other objects (tensors, numbers, functions) shared."""
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, list):
        new = memo[id(value)] = []
        new.extend(_containers(v, memo) for v in value)
    elif isinstance(value, collections.deque):
        new = memo[id(value)] = collections.deque(maxlen=value.maxlen)
        new.extend(_containers(v, memo) for v in value)
    elif isinstance(value, dict):
        new = memo[id(value)] = copy.copy(value)  # keeps OrderedDict / defaultdict's factory
        for k in list(new):
            new[k] = _containers(new[k], memo)
    elif isinstance(value, (set, frozenset)):
        new = memo[id(value)] = type(value)(_containers(v, memo) for v in value)
    elif isinstance(value, tuple) and type(value) is tuple:
        new = tuple(_containers(v, memo) for v in value)
    else:
        return value
    return new


# -- the sample ----------------------------------------------------------------------------
def fake_sample(sample: Any, mode: FakeTensorMode, batch: int, symbolic: bool,
                seq_dims: dict[int, tuple[int, ...]] | None = None,
                batch_dims: tuple[int, ...] | None = None) -> Any:
    """Fake copy of ``sample`` with the batch dim of every tensor set to ``batch``.

    ``batch_dims``: the batch dim of each leaf of ``tree_flatten(sample)`` (default 0).
    ``symbolic=True`` makes that dim the one symbol of the batch size, with ``batch`` as its
    hint (duck sizing gives every tensor the same symbol).  ``seq_dims`` (``id(tensor) ->
    dims``) makes those dims of those tensors the one symbol of the sequence length, hinted
    by their size in the sample (which must differ from ``batch``: duck sizing would merge
    the two symbols).  The same tensor object under two names stays one tensor.

    A dense sample tensor keeps its layout (a channels-last image: the convolutions that read it
    take the channels-last path, as for real); one with gaps (a slice) becomes contiguous, and
    distinct sample tensors that share a storage (one a view of another) become separate
    storages: known limitations.
    """
    converted: dict[int, torch.Tensor] = {}
    seq_dims = seq_dims or {}
    leaves, spec = tree_flatten(sample)
    dims = batch_dims or (0,) * len(leaves)

    def convert(t: torch.Tensor, d: int | None) -> torch.Tensor:
        if id(t) not in converted:
            shape = list(t.shape)
            if d is not None:  # (None: a tensor of one row of a row list, static)
                shape[d] = batch
            meta = (torch.empty(shape, dtype=t.dtype, device="meta") if t.is_contiguous() or not dense(t)
                    else torch.empty_permuted(shape, physical_order(t)[0], dtype=t.dtype, device="meta"))
            ctx = None
            if symbolic and d is not None:
                dynamic = [DimDynamic.STATIC] * t.dim()
                dynamic[d] = DimDynamic.DUCK
                for s in seq_dims.get(id(t), ()):
                    dynamic[s] = DimDynamic.DUCK
                ctx = StatelessSymbolicContext(dynamic_sizes=dynamic)
            converted[id(t)] = _fake(meta, mode, ctx)
        return converted[id(t)]

    return tree_unflatten([convert(t, d) if isinstance(t, torch.Tensor) else t for t, d in zip(leaves, dims)], spec)


def sample_rows(sample: Any, batch_dims: tuple[int | None, ...] | None = None) -> tuple[int, int]:
    """The sample's batch size and the batch dim its tensors share (0 when they differ)."""
    leaves = tree_flatten(sample)[0]
    dims = batch_dims or (0,) * len(leaves)
    found = [(t.shape[d], d) for t, d in zip(leaves, dims) if isinstance(t, torch.Tensor) and d is not None]
    if not found:  # only row lists
        return len(next(row_lists(sample))[1]), 0
    shared = {d for _, d in found}
    return found[0][0], shared.pop() if len(shared) == 1 else 0


# -- row lists: a list of dicts, one per row of the batch (DETR's and torchvision detection's targets) --
def is_row_list(x: Any) -> bool:
    """A list of dicts: one item per row of the batch, whose tensors (a row's targets: their own
    sizes) have no batch dim; its length is the batch size."""
    return isinstance(x, list) and len(x) > 0 and all(isinstance(item, Mapping) for item in x)


def row_lists(sample: Any, path: str = ""):
    """The sample's row lists, each with its path in the sample (``['labels']``)."""
    if is_row_list(sample):
        yield path, sample
    elif isinstance(sample, Mapping):
        for key, value in sample.items():
            yield from row_lists(value, f"{path}[{key!r}]")
    elif isinstance(sample, (list, tuple)):
        for i, value in enumerate(sample):
            yield from row_lists(value, f"{path}[{i}]")


def has_row_lists(dims: tuple[int | None, ...] | None) -> bool:
    """Whether a sample's batch dims (per leaf) say it has row lists (their leaves: None)."""
    return dims is not None and None in dims


def row_list_tensors(sample: Any) -> set[int]:
    """The ids of the tensors in the sample's row lists."""
    return {id(t) for _, rows in row_lists(sample) for t in tree_flatten(rows)[0] if isinstance(t, torch.Tensor)}


def with_rows(sample: Any, dims: tuple[int | None, ...], rows: int) -> tuple[Any, tuple[int | None, ...]]:
    """``sample`` with each row list cycled to ``rows`` items (a repeated row is a copy: its own
    tensors, as a real batch's rows have), everything else as it is; and the batch dim of each
    of its leaves (None in the row lists)."""
    dim_of = {id(t): d for t, d in zip(tree_flatten(sample)[0], dims) if isinstance(t, torch.Tensor)}
    resized = _cycled(sample, rows)
    in_rows = row_list_tensors(resized)
    return resized, tuple(None if id(t) in in_rows else dim_of.get(id(t), 0) for t in tree_flatten(resized)[0])


def _cycled(sample: Any, rows: int) -> Any:
    if next(row_lists(sample), None) is None:
        return sample
    if is_row_list(sample):
        return [sample[i] if i < len(sample) else copy.deepcopy(sample[i % len(sample)]) for i in range(rows)]
    if isinstance(sample, Mapping):
        items = {k: _cycled(v, rows) for k, v in sample.items()}
        try:
            return type(sample)(items)
        except TypeError:
            return items
    return type(sample)(_cycled(v, rows) for v in sample)  # a list or tuple (row_lists looks in no other)


# -- real tensors met during the step --------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Met:
    """A real tensor the step used that is neither the model's nor the sample's."""

    name: str
    description: str  # shape, dtype, bytes
    where: str  # the user's line
    category: Category  # BUFFER (met in the model's forward) or INPUT (elsewhere: the loss)
    batch_dim: int | None  # the dim that follows b (an input with the sample's batch size)

    def __str__(self) -> str:
        if self.category is Category.BUFFER:
            how = "in the model's forward: counted as a buffer"
        elif self.batch_dim is None:
            how = "outside the model: counted as an input"
        else:
            how = (f"outside the model: counted as an input whose dim {self.batch_dim} (the sample's batch size) "
                   "follows b")
        return f"{self.name} {self.description} at {self.where} ({how})"


class RealTensors(TorchDispatchMode):
    """Above the tracker: every real tensor an op receives becomes a fake one (the same fake each
    time it is met), registered with the tracker as state alive before the step (``Met``).  Also
    refuses what the real kernels refuse but the meta kernels do not check (``check_kernel``).

    ``as_batch(t, dim)``: the fake input for a real tensor whose ``dim`` has the sample's batch
    size ``rows`` (met outside the model: a loss target); ``module_names``: the fake model's
    modules by id (a tensor met inside one of their calls is the model's).
    """

    supports_higher_order_operators = True  # a compiled region's RNG operators: passed on as they are

    ignore_compile_internals = staticmethod(compiled.transparent)  # a compiled step runs under it

    def __init__(self, mode: FakeTensorMode, module_names: dict[int, str], rows: int, dim: int,
                 as_batch: Callable[[torch.Tensor, int], torch.Tensor], cuda: bool = False):
        super().__init__()
        self.mode, self.module_names, self.rows, self.dim, self.as_batch = mode, module_names, rows, dim, as_batch
        self.cuda = cuda
        self.met: dict[int, tuple[torch.Tensor, torch.Tensor, Met]] = {}  # id(real) -> (real, fake, Met)
        self.tracker = None

    def track(self, tracker) -> RealTensors:
        """Register the tensors met so far, and those met from now on, with ``tracker``."""
        self.tracker = tracker
        for _, fake, met in self.met.values():
            self._register(fake, met)
        return self

    def notes(self) -> tuple[str, ...]:
        if not self.met:
            return ()
        listed = [str(met) for _, _, met in self.met.values()]
        return (f"the step used {len(listed)} real tensor(s) that are neither the model's nor the sample's (a "
                f"module-level constant, a tensor a loss_fn closes over), counted as memory of the step: "
                f"{_first(listed)}",)

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        watchdog.beat(func)  # the one beat of a capture: this mode is on wherever its step runs ops
        kwargs = kwargs or {}
        if not isinstance(func, torch._ops.OpOverload):  # the generator state a compiled region saves
            return func(*args, **kwargs)
        if (_has_real(args) or kwargs and _has_real(kwargs.values())) and func not in _LIFTS:
            args, kwargs = tree_map_only(torch.Tensor, self._fake_of, (args, kwargs))
        if func in _CHECKED:
            refused = check_kernel(func, args, kwargs, self.cuda)
            if refused is not None:
                module = self._module()
                raise InputError(
                    f"the step would fail for real: {refused} (in {'module ' + repr(module) if module else 'the step'}, "
                    f"at {_line(_user_frame())}): the sample's dtype must match the model's (cast one of them, e.g. "
                    "x.float() or model.double()), or use amp= for mixed precision")
        return func(*args, **kwargs)

    def _fake_of(self, t: torch.Tensor) -> torch.Tensor:
        if not _is_real(t):
            return t
        if id(t) in self.met:
            return self.met[id(t)][1]
        frame = _user_frame()
        in_model = self._module() is not None
        batch_dim = None
        if not in_model and t.dim() > self.dim and t.shape[self.dim] == self.rows:
            batch_dim = self.dim
        with _disable_current_modes():
            if batch_dim is not None:
                fake = self.as_batch(t.detach(), batch_dim)
            else:
                fake = _scalar(t, self.mode) if _is_scalar(t) else _fake(t.detach(), self.mode)
        met = Met(_name_in(frame, t), _describe(t), _line(frame),
                  Category.BUFFER if in_model else Category.INPUT, batch_dim)
        self.met[id(t)] = (t, fake, met)
        if self.tracker is not None:
            self._register(fake, met)
        return fake

    def _register(self, fake: torch.Tensor, met: Met) -> None:
        self.tracker.register({f"real.{met.name}": fake}, met.category)

    def _module(self) -> str | None:
        """The path of the innermost module of the model being called (None: outside the model)."""
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name in ("_call_impl", "_wrapped_call_impl"):
                name = self.module_names.get(id(frame.f_locals.get("self")))
                if name is not None:
                    return name or "(the model)"
            frame = frame.f_back
        return None


_LIFTS = {aten.lift_fresh.default, aten.lift_fresh_copy.default, aten.lift.default}  # torch.tensor(...) in the code

# Ops whose real kernels need one dtype for the tensors at these argument positions, which the
# meta kernels (torch/_meta_registrations.py) do not check.  aten/src/ATen/native/LinearAlgebra.cpp:
# ``mm``/``bmm`` "expected m1 and m2 to have the same dtype"; CPU ``addmm_impl_cpu_`` "self and
# mat2 must have the same dtype" (checked on torch 2.13 CPU: float64 input into a float32
# ``nn.Linear`` fails there, the fake run passed).
_SAME_DTYPE = {
    aten.mm.default: (0, 1), aten.bmm.default: (0, 1), aten.mv.default: (0, 1), aten.dot.default: (0, 1),
    aten.addmm.default: (1, 2), aten.baddbmm.default: (1, 2), aten.addbmm.default: (1, 2),
    aten.addmv.default: (1, 2),
}
_SAME_DTYPE_CPU_SELF = {aten.addmm.default, aten.baddbmm.default, aten.addbmm.default, aten.addmv.default}
# CPU norms: every tensor one dtype, or a bf16/fp16 input with fp32 parameters
# (aten/src/ATen/native/mixed_data_type.h ``check_mixed_data_type``: "mixed dtype (CPU): all
# inputs must share same datatype."; float64 input into a float32 LayerNorm fails on torch 2.13).
_NORMS_CPU = {aten.native_layer_norm.default, aten.native_batch_norm.default,
              aten._native_batch_norm_legit.default, aten._native_batch_norm_legit.no_stats,
              aten._native_batch_norm_legit_no_training.default, aten.native_group_norm.default}


_CHECKED = _SAME_DTYPE.keys() | _NORMS_CPU


def _has_real(values) -> bool:
    """Whether a real (not fake) tensor is among ``values`` or in a list of them (the common
    case, none, must be cheap: this runs for every op)."""
    for a in values:
        if isinstance(a, torch.Tensor):
            if not isinstance(a, FakeTensor) and _is_real(a):
                return True
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) and _is_real(x):
                    return True
    return False


def _is_real(t: torch.Tensor) -> bool:
    """Whether ``t`` holds real data: not a fake tensor, nor a tensor subclass that wraps fake
    ones (torchao's ``Float8TrainingTensor`` or NF4 weight made in the capture)."""
    if isinstance(t, FakeTensor):
        return False
    if is_traceable_wrapper_subclass(t):
        return any(_is_real(x) for x in wrapped(t).values())
    return True


def check_kernel(func, args, kwargs, cuda: bool) -> str | None:
    """What the real kernel refuses about the arguments' dtypes (``_SAME_DTYPE``, ``_NORMS_CPU``)
    where the meta kernel runs (None if nothing): a sample of another dtype than the model
    fails for real, so it must not get a number."""
    positions = _SAME_DTYPE.get(func)
    if positions is not None:
        picked = [args[i] for i in positions if i < len(args)]
        if not cuda and func in _SAME_DTYPE_CPU_SELF and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
            picked.append(args[0])
        dtypes = {t.dtype for t in picked if isinstance(t, torch.Tensor)}
    elif not cuda and func in _NORMS_CPU:
        tensors = [t for t in args if isinstance(t, torch.Tensor)]
        dtypes = {t.dtype for t in tensors}
        if tensors and tensors[0].dtype in (torch.bfloat16, torch.float16) and \
                {t.dtype for t in tensors[1:]} <= {torch.float32}:
            return None  # a half input with fp32 parameters: allowed (mixed_data_type.h)
    else:
        return None
    if len(dtypes) < 2:
        return None
    names = " and ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    return f"{func.__name__.split('.')[0]} needs one dtype but gets {names}"


# -- the user's line and names ---------------------------------------------------------------
_INTERNAL = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))


def _user_frame():
    """The innermost frame outside torch and fxmem (the user's code), or None."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame = frame.f_back
    return frame


def _line(frame) -> str:
    if frame is None:
        return "(no user frame)"
    import linecache

    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}" + (f": {code}" if code else "")


def _name_in(frame, t: torch.Tensor) -> str:
    """The name ``frame`` knows ``t`` by (a local, a closure variable, a global), else "tensor"."""
    if frame is not None:
        for scope in (frame.f_locals, frame.f_globals):
            for name, value in scope.items():
                if value is t:
                    return name
    return "tensor"


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() if t.device.type != "meta" else t.numel() * t.element_size()


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}, {_nbytes(t):,} B"


def _first(items: list[str], n: int = 8) -> str:
    return "; ".join(items[:n]) + (f"; and {len(items) - n} more" if len(items) > n else "")


@contextlib.contextmanager
def deep_copies_in_mode():
    """``copy.deepcopy`` of a fake tensor, for the block: a clone in the tensor's own fake mode
    (what a user's step gets from ``copy.deepcopy(model)`` or ``torch.optim.swa_utils.AveragedModel``:
    an EMA copy of the fake model).  Torch's own path copies the storage and rebuilds the tensor
    in a new fake mode, which the next op refuses ("Mixing fake modes").  The clone is a new
    storage, as the real deep copy is; ``requires_grad`` and the parameter flag are kept."""
    saved = FakeTensor.__dict__.get("__deepcopy__")

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            with self.fake_mode:
                new = self.detach().clone()
            if isinstance(self, nn.Parameter) or getattr(self, "_is_param", False):
                new = nn.Parameter(new, requires_grad=self.requires_grad)
            else:
                new.requires_grad_(self.requires_grad)
            memo[id(self)] = new
        return memo[id(self)]

    FakeTensor.__deepcopy__ = __deepcopy__
    try:
        yield
    finally:
        if saved is None:
            del FakeTensor.__deepcopy__
        else:
            FakeTensor.__deepcopy__ = saved
