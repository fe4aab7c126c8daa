"""A ``Request`` checked into what its captures run: ``check(request) -> Checked``.

Every argument of ``estimator.report`` is checked here, before anything is captured, and each
bad one is an ``InputError`` that names it: the model (not scripted; a ``torch.compile`` wrapper
unwrapped), the sample's layout (its batch size and batch dims, row lists), ``dynamic=`` (the dims
that are ``s``), the mode and generation arguments, the device and GPU, the strategy against the
model and batch, the precision; the result carries the ``StepSpec`` the capture runs and the notes
the checks found worth saying.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from estimator.capture import compiled, steps
from estimator.capture.fake import has_row_lists, row_list_tensors, row_lists
from estimator.capture.records import StepSpec
from estimator.vocab.categories import Mode
from estimator.vocab.data_dependent import Policy
from estimator.vocab.errors import InputError
from estimator.vocab.request import DEFAULT_OPTIMIZER, DEVICES, Request
from estimator.vocab.strategy import DEFAULT, Strategy, blocks, select
from estimator.vocab.target import target_spec
from estimator.vocab.units import as_int


@dataclasses.dataclass(frozen=True)
class Checked:
    """A ``Request`` checked: what its captures run (``spec``) and what the report says of it."""

    model: nn.Module
    sample: Any
    spec: StepSpec
    batch: int
    seq_dims: dict[int, tuple[int, ...]] | None  # dynamic=: id(sample tensor) -> the dims that are s
    seq: int | None  # the sample's sequence length (dynamic=)
    optimizer_name: str | None
    notes: tuple[str, ...]  # what the checks found worth saying (the default GPU, ...)
    request: Request  # as the user gave it (a dtype formula checks cast copies of it again)

    @property
    def strategy(self) -> Strategy:
        return self.spec.strategy

    @property
    def capture_spec(self) -> StepSpec:
        """What the capture runs: the step of one device at the batch ``b // microbatches`` (a
        pipeline's micro-batch; the per-device strategies apply to the captured step); with a
        mesh, rank ``spec.rank``'s step of the job's own parallel code."""
        s = self.spec.strategy
        single = Strategy(accumulate=s.accumulate, checkpoint=s.checkpoint, checkpoint_reentrant=s.checkpoint_reentrant,
                          master_weights=s.master_weights, mesh=s.mesh, parallelize=s.parallelize)
        return dataclasses.replace(self.spec, strategy=single)

    def with_policy(self, policy: Policy) -> Checked:
        """The same request, its captures run under the data-dependent ``policy``."""
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, data_dependent=policy))

    def at_rank(self, rank: int) -> Checked:
        """The same request, rank ``rank``'s step captured (``Strategy(mesh=)``)."""
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, rank=rank))

    @property
    def microbatches(self) -> int:
        return self.strategy.microbatches or 1


def check(request: Request) -> Checked:
    """``request`` checked, each bad argument named in an ``InputError``; the step to capture."""
    model, sample, batch, mode, optimizer = request.model, request.sample, request.batch, request.mode, request.optimizer
    loss_fn, device, gpu, alloc_conf = request.loss_fn, request.device, request.gpu, request.alloc_conf
    amp, grad_scaler, dynamic, strategy = request.amp, request.grad_scaler, request.dynamic, request.strategy
    data_dependent, batch_dims, user_step = request.data_dependent, request.batch_dims, request.step
    keep_output, new_tokens, compile = request.keep_output, request.new_tokens, request.compile
    cache_implementation = request.cache_implementation
    notes = []
    model, compiled_as = _module(model, notes)
    compile_strategy = getattr(strategy, "compile", False)
    if compile is not None and compile_strategy:
        raise InputError("compile= and Strategy(compile=) both say how the model is compiled: give one")
    if compile is not None or compile_strategy:
        compiled_as = compiled.spec_of(compile if compile is not None else compile_strategy)
    sample_batch, dims = _sample_layout(sample, batch_dims)
    batch = sample_batch if batch is None else as_int(batch, "batch")
    mode_ = _mode(mode)
    if compiled_as is not None and mode_ is Mode.GENERATE:
        raise InputError("mode='generate' of a compiled model is not modelled: pass the eager model (or "
                         "compile=False) for an eager estimate")
    generation = _generation(model, sample, mode_, user_step, new_tokens, cache_implementation)
    if generation is not None:
        given = [name for name, value in (("loss_fn", loss_fn), ("amp", amp), ("grad_scaler", grad_scaler),
                                          ("keep_output", keep_output), ("strategy", strategy)) if value is not None]
        if given:
            raise InputError(f"mode='generate' runs model.generate() as it is: drop {', '.join(given)} (cast the "
                             "model, e.g. model.to(torch.bfloat16), for a low-precision generation)")
        # generate() is captured as a step of its own (``steps.Generation`` is a step function: the
        # prefill and the decode steps, in eval mode, no optimizer): from here on the capture runs
        # it as it runs a user's step= (``StepSpec.step``), with ``mode`` GENERATE marking it.
        user_step = generation
    device_ = device_name(device)
    if loss_fn is not None and not callable(loss_fn):
        raise InputError(f"loss_fn must be callable (output, sample) -> scalar, got {type(loss_fn).__name__}")
    seq_dims, seq = _seq_dims(sample, dynamic, dims)
    target, target_notes = target_spec(device_, gpu, alloc_conf)
    notes = [*target_notes, *notes]
    _check_user_step(user_step, loss_fn, amp, grad_scaler, strategy, keep_output)
    if user_step is not None:
        factory = steps.state_factory(optimizer) if mode_ is Mode.TRAIN else None
    else:
        factory = steps.optimizer_factory(optimizer) if mode_ is Mode.TRAIN else None
    if keep_output is not None and not isinstance(keep_output, bool):
        raise InputError(f"keep_output must be True or False, got {keep_output!r}")
    strategy = _strategy(strategy, mode_, model, batch)
    if has_row_lists(dims) and (strategy.accumulate > 1 or strategy.pipeline > 1):
        raise InputError("gradient accumulation and pipeline micro-batches split the sample's tensors along their "
                         "batch dim: a sample with a row list (a list of dicts, one per row) is not split; estimate "
                         "one micro-batch (batch=) instead")
    if strategy.master_weights:
        factory = _master_weights(model, factory)
    amp, grad_scaler = _precision_of(strategy, amp, grad_scaler)
    precision = steps.Precision.of(amp, grad_scaler, mode_)
    spec = StepSpec(mode_, factory, loss_fn or steps.default_loss, target, precision, strategy,
                    Policy.of(data_dependent), dims, keep_output is not False, user_step, compiled_as)
    if mode_ is Mode.TRAIN and optimizer is None:
        notes.append("optimizer=None: no optimizer step and no optimizer state")
    if mode_ is not Mode.TRAIN and optimizer is not None and optimizer != DEFAULT_OPTIMIZER:
        notes.append(f"optimizer={optimizer_name(optimizer)!r} is ignored: inference has no optimizer step")
    if batch_dims is None:
        notes.extend(_sequence_first(model))
    if generation is not None:
        notes.append(f"the step is {generation}: the prefill of the prompt, then {generation.new_tokens - 1} decode "
                     "step(s), each a call of the model on the last token with the cache")
    elif user_step is not None:
        notes.append(f"the step is yours ({optimizer_name(user_step)}), captured as it ran; its phases were found "
                     "from its backward() and optimizer.step() calls (ops after a backward outside any module call, "
                     "such as clipping or an EMA update, count as the optimizer phase)")
    name = optimizer_name(optimizer) if mode_ is Mode.TRAIN else None
    return Checked(model, sample, spec, batch, seq_dims, seq, name, tuple(notes), request)


def _check_user_step(user_step, loss_fn, amp, grad_scaler, strategy, keep_output) -> None:
    """``report(step=)`` checked: a callable, and none of the arguments that shape the built-in
    step (the user's step does that itself)."""
    if user_step is None:
        return
    if not callable(user_step):
        raise InputError(f"step must be a callable step(model, sample, state), got {type(user_step).__name__}")
    given = [name for name, value in (("loss_fn", loss_fn), ("amp", amp), ("grad_scaler", grad_scaler),
                                      ("keep_output", keep_output)) if value is not None]
    if given:
        raise InputError(f"{', '.join(given)} shape{'s' if len(given) == 1 else ''} the built-in step; with step= your "
                         "step computes its loss, autocasts (torch.autocast) and keeps what it keeps itself: "
                         f"drop {' and '.join(given)}")
    # accumulate=k with a step of yours: b is the optimizer step's batch, the step is handed all of
    # its k micro-batches' rows and splits them itself (steps.micro_batches); the capture's symbol
    # is the micro-batch, so the formulas stay polynomial in b.
    if strategy is not None and isinstance(strategy, Strategy) and (
            dataclasses.replace(strategy, checkpoint=None, checkpoint_reentrant=False, accumulate=1, mesh=None,
                                parallelize=None) != DEFAULT):
        raise InputError(f"strategy={strategy.describe()!r} transforms the built-in step (precision, data, sharding "
                         "and pipeline parallelism) and cannot combine with step=; with your own step, "
                         "Strategy(checkpoint=...) applies (it wraps modules) and Strategy(accumulate=k) (your step "
                         "gets the k micro-batches' rows and splits them itself), the rest is yours to write in the "
                         "step or to estimate with the built-in step")


def _module(model, notes: list[str]) -> tuple[nn.Module, compiled.Compiled | None]:
    """``model`` checked: an ``nn.Module``, not scripted; a ``torch.compile`` wrapper unwrapped,
    with how it compiles (``compiled.of``; None: eager)."""
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    scripted = [(f"module {path!r}" if path else "the model", type(m).__name__) for path, m in model.named_modules()
                if isinstance(m, torch.jit.ScriptModule)]
    if scripted:
        (where, kind), = scripted[:1]
        raise InputError(f"{where} is a torch.jit scripted or traced module ({kind}): fxmem captures the eager step "
                         "and cannot run a scripted one on fake tensors; pass the eager module (the one given to "
                         "torch.jit.script / torch.jit.trace)")
    model, compiled_as = compiled.of(model)
    # a submodule torch.compile wrapped runs as a compiled region of the step (compiled.submodule_regions);
    # one compiled in place (module.compile()) runs eager
    inner = [path for path, m in model.named_modules() if path and getattr(m, "_compiled_call_impl", None) is not None]
    if inner:
        notes.append(f"module {inner[0]!r} is compiled in place (module.compile()): estimated as eager (fxmem "
                     "compiles the whole model, or submodules that torch.compile wrapped: pass compile= or "
                     "assign the module torch.compile returns)")
    return model, compiled_as


def _mode(mode) -> Mode:
    try:
        return Mode(mode.lower() if isinstance(mode, str) else mode)
    except ValueError:
        raise InputError(f"mode must be 'train', 'inference' or 'generate', got {mode!r}") from None


def _generation(model: nn.Module, sample: Any, mode: Mode, user_step, new_tokens,
                cache_implementation) -> steps.Generation | None:
    """``mode="generate"``'s arguments, checked: a model with ``generate()``, a dict sample (its
    ``input_ids``), ``new_tokens >= 1``, a cache implementation fxmem knows."""
    if mode is not Mode.GENERATE:
        given = [n for n, v in (("new_tokens", new_tokens), ("cache_implementation", cache_implementation)) if v is not None]
        if given:
            raise InputError(f"{' and '.join(given)} belong{'s' if len(given) == 1 else ''} to mode='generate', "
                             f"got mode={mode.value!r}")
        return None
    if user_step is not None:
        raise InputError("mode='generate' runs model.generate(); for a generation loop of your own pass it as "
                         "step= with mode='inference'")
    if not callable(getattr(model, "generate", None)):
        raise InputError(f"mode='generate' needs a model with generate() (a transformers causal LM), got "
                         f"{type(model).__name__}")
    if not isinstance(sample, Mapping) or not isinstance(sample.get("input_ids"), torch.Tensor):
        raise InputError("mode='generate' takes the sample as generate(**sample) does: a dict with 'input_ids' "
                         "(and 'attention_mask'), e.g. {'input_ids': ids}")
    if new_tokens is None:
        raise InputError("mode='generate' needs new_tokens=, the tokens to generate per sequence")
    n = as_int(new_tokens, "new_tokens")
    if cache_implementation not in steps.CACHE_IMPLEMENTATIONS:
        raise InputError(f"cache_implementation must be one of {steps.CACHE_IMPLEMENTATIONS}, got "
                         f"{cache_implementation!r}")
    return steps.Generation(n, cache_implementation)


def device_name(device) -> str:
    """The target's device type from a ``torch.device`` or a string (any case; an index such as
    ``"cuda:1"`` names a device of that type: the prediction is the same for each)."""
    if isinstance(device, torch.device):
        name = device.type
    elif isinstance(device, str):
        name, _, index = device.strip().lower().partition(":")
        if index and not index.isdigit():
            name = device
    else:
        name = device
    if name not in DEVICES:
        raise InputError(f"device must be one of {DEVICES} (or e.g. 'cuda:1'), got {device!r}")
    return name


_SEQUENCE_FIRST = (nn.RNNBase, nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer,
                   nn.Transformer)


def _sequence_first(model: nn.Module) -> list[str]:
    """A note when a module reads dim 1 of its input as the batch (``batch_first=False``) but the
    sample's batch is dim 0 (no ``batch_dims``)."""
    found = [(path, m) for path, m in model.named_modules()
             if isinstance(m, _SEQUENCE_FIRST) and getattr(m, "batch_first", True) is False]
    if not found:
        return []
    path, m = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return [f"{type(m).__name__} {path or '(the model)'!r}{more} is sequence-first (batch_first=False): it reads "
            "dim 1 of its input as the batch, but b is dim 0 of the sample; if the sample is (seq, batch, ...), pass "
            "batch_dims=1 (fxmem --batch-dim 1), else the formula is in the sequence length"]


def _master_weights(model: nn.Module, factory):
    """The optimizer behind fp32 master weights, for a model with low-precision parameters."""
    if factory is None:
        raise InputError("Strategy(master_weights=True) keeps fp32 copies for the optimizer: give an optimizer")
    dtypes = {p.dtype for p in steps.trainable(model) if p.is_floating_point()}
    if not dtypes - {torch.float32, torch.float64}:
        raise InputError("Strategy(master_weights=True) keeps fp32 copies of low-precision parameters, but the "
                         f"model's are {', '.join(sorted(str(d) for d in dtypes)) or 'not floating point'}: "
                         "cast it first (model.to(torch.bfloat16))")
    return steps.master_weights(factory)


def _precision_of(strategy: Strategy, amp, grad_scaler):
    """``report(amp=, grad_scaler=)`` or the strategy's (they must agree when both are given)."""
    for name, given, own in (("amp", amp, strategy.amp), ("grad_scaler", grad_scaler, strategy.grad_scaler)):
        if given is not None and own is not None and given != own:
            raise InputError(f"report({name}={given!r}) and Strategy({name}={own!r}) disagree: give one")
    return (amp if amp is not None else strategy.amp,
            grad_scaler if grad_scaler is not None else strategy.grad_scaler)


def _strategy(strategy: Strategy | None, mode: Mode, model: nn.Module, batch: int) -> Strategy:
    """``strategy`` checked against the mode, the model (checkpointed modules exist) and ``batch``."""
    if strategy is None:
        return DEFAULT
    if not isinstance(strategy, Strategy):
        raise InputError(f"strategy must be an estimator.vocab.strategy.Strategy, got {type(strategy).__name__}")
    if mode is not Mode.TRAIN and dataclasses.replace(strategy, amp=None, grad_scaler=None, mesh=None,
                                                      parallelize=None) != DEFAULT:
        raise InputError(f"strategy={strategy.describe()!r}: strategies apply to mode='train' only")
    if strategy.pipeline > 1 and (strategy.split_points is not None or len(blocks(model)) < strategy.pipeline):
        from estimator.ranks import pipeline

        pipeline.split(model, strategy)  # the cut's errors (too few stages) before the batch's and the capture
    strategy.check_batch(batch)
    strategy.checkpointed(model)
    select(model, strategy.shard_modules, "shard_modules")
    return strategy


def _seq_dims(sample: Any, dynamic: Mapping | None, batch_dims: tuple[int, ...] | None = None,
              ) -> tuple[dict[int, tuple[int, ...]] | None, int | None]:
    """``dynamic`` as ``{id(sample tensor): dims}`` and the sequence length they share
    (``batch_dims``: per leaf of ``tree_flatten(sample)``, the dims that are ``b``)."""
    if dynamic is None:
        return None, None
    if not isinstance(dynamic, Mapping) or not dynamic:
        raise InputError(f"dynamic must be a non-empty dict such as {{'input_ids': {{1: 's'}}}}, got {dynamic!r}")
    if isinstance(sample, torch.Tensor) and all(isinstance(k, int) and isinstance(v, str) for k, v in dynamic.items()):
        dynamic = {None: dynamic}  # {1: "s"} for a single-tensor sample
    batch_dim = _dims_by_id(sample, batch_dims)
    seq_dims, sizes = {}, {}
    for key, dims in dynamic.items():
        t = sample if key is None else _lookup(sample, key, "dynamic", "{1: 's'}")
        if not isinstance(dims, Mapping) or not dims:
            raise InputError(f"dynamic[{key!r}] must map dims to 's', e.g. {{1: 's'}}, got {dims!r}")
        bd = batch_dim.get(id(t), 0)
        for d, name in dims.items():
            if name == "b" and d == bd:
                continue  # the batch dim is the batch anyway
            if name != "s":
                raise InputError(f"dynamic[{key!r}][{d!r}] = {name!r}: only 's' (sequence length) is supported "
                                 f"besides dim {bd} = 'b'")
            if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < t.dim() or d == bd:
                raise InputError(f"dynamic[{key!r}]: dim {d!r} is not a dim of that tensor besides the batch (shape "
                                 f"{tuple(t.shape)}; dim {bd} is the batch)")
            seq_dims.setdefault(id(t), ())
            seq_dims[id(t)] += (d,)
            sizes.setdefault(t.shape[d], f"{key!r}[{d}]")
    if len(sizes) > 1:
        detail = ", ".join(f"{where}: {size}" for size, where in sizes.items())
        raise InputError(f"the dims named 's' must have one size in the sample, got {detail}")
    seq = next(iter(sizes))
    if seq < 2:
        raise InputError(f"the sample's sequence length must be >= 2 to stay a symbol, got {seq}")
    return seq_dims, seq


def _lookup(sample: Any, key, argument: str, single: str) -> Any:
    """``sample[key]`` for ``report(argument=)`` (a tensor for ``dynamic``, anything holding
    tensors for ``batch_dims``)."""
    try:
        t = sample[key]
    except (KeyError, IndexError, TypeError):
        where = list(sample) if isinstance(sample, Mapping) else (
            f"positions 0..{len(sample) - 1}" if isinstance(sample, Sequence) else f"a single tensor: use {single}")
        raise InputError(f"{argument} names {key!r}, which the sample does not have ({where})") from None
    if argument == "dynamic" and not isinstance(t, torch.Tensor):
        raise InputError(f"dynamic names {key!r}, which is a {type(t).__name__}, not a tensor")
    return t


def sample_batch(sample: Any, batch_dims: int | Mapping | None = None) -> int:
    """The sample's batch size (``batch_dims``: ``report``'s argument)."""
    return _sample_layout(sample, batch_dims)[0]


def _sample_layout(sample: Any, batch_dims: int | Mapping | None) -> tuple[int, tuple[int, ...] | None]:
    """The sample checked: its batch size and the batch dim of each leaf of ``tree_flatten(sample)``
    (None: dim 0 of every tensor)."""
    if not isinstance(sample, (torch.Tensor, Mapping, Sequence)) or isinstance(sample, (str, bytes)):
        raise InputError(
            f"sample must be a tensor, a tuple/list or a dict of tensors, got {type(sample).__name__}"
        )
    named = list(_named_tensors(sample))
    if not named:
        raise InputError("the sample holds no tensor: give at least one tensor whose dim 0 is the batch")
    in_rows = row_list_tensors(sample)
    for path, t in named:
        if t.dim() == 0 and id(t) not in in_rows:
            raise InputError(f"sample tensor {path or 'sample'} is a scalar: every tensor needs a batch dim")
    dims = _batch_dims(sample, batch_dims)
    dim_of = _dims_by_id(sample, dims)
    sizes = {}
    for path, t in named:
        if id(t) not in in_rows:
            sizes.setdefault(t.shape[dim_of.get(id(t), 0)], f"{path or 'sample'}" + (
                f" (dim {dim_of.get(id(t), 0)})" if dims is not None else ""))
    for path, rows in row_lists(sample):
        sizes.setdefault(len(rows), f"{path or 'sample'} (a list of {len(rows)} dicts: one per row)")
    if len(sizes) > 1:
        detail = ", ".join(f"{name}: {size}" for size, name in sizes.items())
        which = "dim 0" if dims is None else "their batch_dims"
        raise InputError(f"the sample's tensors disagree on the batch size ({which}): {detail}")
    if in_rows:  # their tensors have no batch dim
        dims = tuple(None if id(t) in in_rows else dim_of.get(id(t), 0) for t in tree_flatten(sample)[0])
    return next(iter(sizes)), dims


def _batch_dims(sample: Any, batch_dims: int | Mapping | None) -> tuple[int, ...] | None:
    """``report(batch_dims=)`` as the batch dim of each leaf of ``tree_flatten(sample)`` (None
    when not given): a plain int for every tensor, or ``{key: dim}`` by dict key / tuple
    position (the tensors under that key; other tensors dim 0)."""
    if batch_dims is None:
        return None
    chosen: dict[int, int] = {}

    def assign(value, d, where: str) -> None:
        for t in tree_flatten(value)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            if isinstance(d, bool) or not isinstance(d, numbers.Integral) or not -t.dim() <= d < t.dim():
                raise InputError(f"{where} = {d!r} is not a dim of the sample tensor of shape {tuple(t.shape)}")
            dim = int(d) % t.dim()
            if chosen.setdefault(id(t), dim) != dim:
                raise InputError(f"{where}: one tensor of the sample is given two batch dims ({chosen[id(t)]}, {dim})")

    if isinstance(batch_dims, numbers.Integral) and not isinstance(batch_dims, bool):
        assign(sample, batch_dims, "batch_dims")
    elif isinstance(batch_dims, Mapping) and batch_dims and not isinstance(sample, torch.Tensor):
        for key, d in batch_dims.items():
            assign(_lookup(sample, key, "batch_dims", "a plain int"), d, f"batch_dims[{key!r}]")
    else:
        raise InputError(f"batch_dims must be an int (every tensor's batch dim; the only form for a single-tensor "
                         f"sample) or a non-empty dict {{key or position: dim}}, got {batch_dims!r}")
    return tuple(chosen.get(id(t), 0) if isinstance(t, torch.Tensor) else 0 for t in tree_flatten(sample)[0])


def _dims_by_id(sample: Any, dims: tuple[int, ...] | None) -> dict[int, int]:
    leaves = tree_flatten(sample)[0]
    return {id(t): d for t, d in zip(leaves, dims or (0,) * len(leaves)) if isinstance(t, torch.Tensor)}


def _named_tensors(sample: Any, prefix: str = ""):
    if isinstance(sample, torch.Tensor):
        yield prefix, sample
    elif isinstance(sample, Mapping):
        for k, v in sample.items():
            yield from _named_tensors(v, f"{prefix}[{k!r}]")
    elif isinstance(sample, Sequence) and not isinstance(sample, (str, bytes)):
        for i, v in enumerate(sample):
            yield from _named_tensors(v, f"{prefix}[{i}]")


def optimizer_name(optimizer) -> str | None:
    if optimizer is None or isinstance(optimizer, str):
        return optimizer
    return getattr(optimizer, "__name__", type(optimizer).__name__)
