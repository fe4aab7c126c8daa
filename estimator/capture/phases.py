"""What the capture marks while the step runs, besides the ops themselves.

The phase each op belongs to (the built-in step's callbacks, ``on_phase``; found as a user's step
runs, ``phases``) and what each phase leaves behind (activations, gradients, optimizer state:
``label_storages``); the state alive before the step (``register_state``, less what the target
keeps in host memory: ``host_state``) and where a real run makes it (``mark_births``,
``lazy_births``, ``run_marks``); the parameter each storage belongs to (``name_owners``), the
order gradients are made in (``grad_order``), each op's module path (``module_hooks``), and
``generate()``'s model calls and KV cache (``decoding``).  Every hook and patch is removed on exit.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer
from torch.utils._pytree import tree_flatten

from estimator import corrections
from estimator.capture import generation, steps, world
from estimator.capture.fake import deep_copies_in_mode
from estimator.capture.records import Decoding, RunMarks, StepSpec
from estimator.capture.symbols import hint
from estimator.capture.tracker import Tracker
from estimator.corrections.cuda import autocast as cuda_autocast
from estimator.vocab.categories import Birth, Born, Category, Phase


def lazy_births(optimizers: list, constructed: set[int], scalers: list) -> dict[int, Born]:
    """``id(tensor) -> Born`` of the state a real run's first step makes: each optimizer's state
    but what its constructor made (Adagrad), made by its first ``step()``
    (``Optimizer._init_group``/``_init_state`` run inside it); a ``GradScaler``'s scale and growth
    tracker, made by its first ``scale(loss)`` (counted from the first backward)."""
    born = {}
    for i, optimizer in enumerate(optimizers):
        for param, values in optimizer.state.items():
            if id(param) not in constructed:
                born |= {id(v): Born(Birth.OPTIMIZER, i) for v in values.values() if isinstance(v, torch.Tensor)}
    for scaler in scalers:
        born |= {id(t): Born(Birth.BACKWARD) for t in steps.scaler_state(scaler).values()}
    return born


def mark_births(tracker: Tracker, model: nn.Module, state: dict, lazy: dict[int, Born]) -> None:
    """``Storage.born`` of the state alive before the step: parameters and buffers in the order
    ``model.to(device)`` moves them (``Module._apply``: children first, then the module's own
    parameters, then its buffers; tensors it holds elsewhere after them), inputs a new batch per
    step, gradients a step keeps made by the first backward, optimizer state by ``lazy`` (else
    made before the first step: an EMA copy, a constructor's state, what a user's step keeps)."""

    def walk(module: nn.Module):
        for child in module.children():
            yield from walk(child)
        yield from (t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None)

    order = {}
    for t in walk(model):
        order.setdefault(tracker.key_of(t), len(order))
    by_category = {Category.INPUT: Born(Birth.BATCH), Category.GRADIENT: Born(Birth.BACKWARD)}
    for category, tensors in state.items():
        for t in tensors.values():
            key = tracker.key_of(t)
            if key is None or tracker.storages[key].born is not None:
                continue
            if category in (Category.PARAMETER, Category.BUFFER):
                born = Born(Birth.LOAD, order.get(key, len(order)))
            else:
                born = by_category.get(category) or lazy.get(id(t), Born(Birth.SETUP))
            tracker.storages[key].born = born
    for stored in tracker.storages.values():  # storages no tensor names (a user's step keeps them)
        if stored.op < 0 and stored.born is None:
            stored.born = Born(Birth.SETUP)


def register_state(tracker: Tracker, state: dict, kept: list, elsewhere: set[int]) -> None:
    """The tensors alive before the step, by category (but those the target keeps elsewhere:
    ``elsewhere``, ids), and the storages a user's step keeps that no tensor names (as
    optimizer state)."""
    for category, tensors in state.items():
        tracker.register({name: t for name, t in tensors.items() if id(t) not in elsewhere}, category)
    tracker.register_storages(kept, Category.OPTIMIZER_STATE)


@contextlib.contextmanager
def run_marks(tracker: Tracker, model: nn.Module, optimizers: list, watch_model: bool):
    """``RunMarks`` of the recorded step: the op each optimizer's ``step()`` starts at and, with
    ``watch_model`` (the built-in step), the op the first call of the model returns before;
    yields a dict whose ``"marks"`` is set when the step has run."""
    starts: dict[int, int] = {}
    returns: list[int] = []
    index = {id(optimizer): i for i, optimizer in enumerate(optimizers)}

    def step_started(optimizer, *_):
        if id(optimizer) in index:
            starts.setdefault(index[id(optimizer)], len(tracker.ops))

    handles = [torch_optimizer.register_optimizer_step_pre_hook(step_started)]
    compiled_call = getattr(model, "_compiled_call_impl", None)
    if watch_model and compiled_call is None:
        handles.append(model.register_forward_hook(lambda *_: returns.append(len(tracker.ops))))
    elif watch_model:  # a forward hook would run inside the compiled region, traced: its len() frozen there
        def call(*args, **kwargs):
            out = compiled_call(*args, **kwargs)
            returns.append(len(tracker.ops))
            return out

        model._compiled_call_impl = call
    found: dict[str, RunMarks] = {}
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()
        if watch_model and compiled_call is not None:
            model._compiled_call_impl = compiled_call
    found["marks"] = RunMarks(tuple(starts.get(i) for i in range(len(optimizers))), returns[0] if returns else None)


def _bytes_per_token(t: torch.Tensor) -> int:
    """A cache's keys or values, (batch, heads, tokens, head_dim): bytes per token and sequence."""
    return t.element_size() * math.prod(hint(n) for n in (*t.shape[1:-2], t.shape[-1]))


@contextlib.contextmanager
def decoding(tracker: Tracker, model: nn.Module, shape_env=None):
    """While ``model.generate`` is recorded: the op each call of the model starts at, and after
    each call the KV cache its output carries (``cache``, ``past_key_values`` before transformers
    renamed it: every tensor the cache object holds) labelled ``Category.KV_CACHE`` for its whole life (a dynamic cache's ``torch.cat``
    results, a static cache's buffers); yields a dict whose ``"decoding"`` is set when the step
    has run, and ``"guard_marks"``: the shape environment's number of guards as each call started
    (``symbols.to_batch_symbol`` splits the guards by call)."""
    calls: list[int] = []
    last: dict[str, Any] = {}

    def returned(module, args, output):
        keys = output.keys() if isinstance(output, Mapping) else ()  # a ModelOutput: its fields that are set
        name = next((k for k in ("cache", "past_key_values") if k in keys), None)  # transformers >= 5.2x: cache
        if name is None:
            return
        cache = output[name]
        tensors = [t for t in steps.tensors_in(cache).values() if t.dim() >= 3]
        for t in tensors:
            _relabel(tracker, t, Category.KV_CACHE)
        per_token = [_bytes_per_token(t) for t in tensors]
        layers = getattr(cache, "layers", None)
        per_layer = tuple(sum(_bytes_per_token(t) for t in steps.tensors_in(layer).values() if t.dim() >= 3)
                          for layer in layers) if isinstance(layers, list) else ()
        tokens = max((hint(t.shape[-2]) for t in tensors), default=0)
        steady = generation.cache_steady(cache)
        settled = last.get("steady_from", 0)
        if settled is not None and not steady:  # None: never steady; False: from the next call at the earliest
            settled = None if steady is None else len(calls)
        last.update(bytes_per_token=sum(per_token), tokens=tokens, grown=tokens - last.get("tokens", tokens),
                    cache=type(cache).__name__, steady_from=settled, layer_bytes=per_layer)

    marks: list[int] = []  # the shape environment's guards as each call starts (s symbolic: each step adds some)

    def called(*_):
        calls.append(len(tracker.ops))
        marks.append(len(shape_env.guards) if shape_env is not None else 0)

    handles = [model.register_forward_pre_hook(called), model.register_forward_hook(returned)]
    found: dict[str, Any] = {}
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()
    found["decoding"] = Decoding(tuple(calls), **last)
    found["guard_marks"] = tuple(marks)


@contextlib.contextmanager
def user_step_context(spec: StepSpec):
    """While a user's step is captured: its ``GradScaler`` assumes finite gradients on fake
    tensors (``steps.finite_gradients``), a deep copy of the fake model (an EMA copy) stays in the
    capture's fake mode (``deep_copies_in_mode``), and on the CUDA target its
    ``torch.autocast("cuda")`` regions autocast the fake CPU tensors with CUDA's op lists
    (``cuda_autocast.device_autocast``)."""
    if spec.step is None:
        yield
        return
    with steps.finite_gradients(), deep_copies_in_mode(), (
            cuda_autocast.device_autocast(cuda_lists=spec.compiled is None) if spec.target.is_cuda
            else contextlib.nullcontext()):
        yield


@contextlib.contextmanager
def phases(tracker: Tracker, model: nn.Module):
    """The phases of a user's step, found as it runs: ops inside ``backward()`` /
    ``torch.autograd.grad`` (the autograd engine running) are the backward, ops inside an
    ``optimizer.step()`` the optimizer step; after a backward, ops outside any module call
    (gradient clipping, an EMA update) belong to the optimizer phase, until a module is called
    again (the next forward).  Each change labels what the phase left behind, as the built-in
    step's callbacks do."""
    changed = on_phase(tracker, model)
    depth = [0, 0]  # backward calls, optimizer steps in progress

    def backward(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return wrapped

    def now() -> Phase:
        if depth[0] or torch._C._current_graph_task_id() != -1:
            return Phase.BACKWARD
        if depth[1]:
            return Phase.OPTIMIZER
        if tracker.phase is Phase.FORWARD or tracker.in_module():
            return Phase.FORWARD
        return Phase.OPTIMIZER

    def update() -> None:
        phase = now()
        if phase is not tracker.phase:
            changed(phase)

    def enter(*_):
        depth[1] += 1

    def leave(*_):
        depth[1] -= 1

    saved = torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad
    torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad = map(backward, saved)
    handles = [torch_optimizer.register_optimizer_step_pre_hook(enter),
               torch_optimizer.register_optimizer_step_post_hook(leave)]
    tracker.before_op = update
    try:
        yield
    finally:
        tracker.before_op = None
        torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad = saved
        for handle in handles:
            handle.remove()


def host_state(spec: StepSpec, optimizers: list) -> list[torch.Tensor]:
    """The optimizers' tensors the target keeps in host memory (``corrections.on_host``; never
    counted on the device, ``Tracker.keep_on_host``): state, and the parameters an optimizer steps
    with their gradients where a rule says so of the keys ``"param"`` and ``"grad"`` (host copies
    of the model's parameters: torchao's ``CPUOffloadOptimizer``)."""
    return _state_where(spec, optimizers, corrections.on_host, with_params=True)


def host_note(host: list[torch.Tensor]) -> tuple[str, ...]:
    """What ``host_state`` keeps off the device, beyond step counts."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in host if t.dim()}
    if not storages:
        return ()
    return (f"the optimizer keeps {sum(storages.values()):,} B in host memory (the parameters it steps there, their "
            "gradients and its state: torchao's CPUOffloadOptimizer), not in the device figures; its host-device "
            "copies are in place, their streams' timing is not modelled",)


def managed_state(spec: StepSpec, optimizers: list) -> dict[int, int]:
    """The optimizer state tensors the target keeps in CUDA managed memory, outside the caching
    allocator: id -> bytes (not in the allocator's timeline: ``RawCapture.managed``)."""
    return {id(t): t.untyped_storage().nbytes() for t in _state_where(spec, optimizers, corrections.in_managed_memory)}


def _state_where(spec: StepSpec, optimizers: list, rule, with_params: bool = False) -> list[torch.Tensor]:
    found = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                items = list(optimizer.state.get(p, {}).items())
                if with_params:
                    items += [("param", p), ("grad", p.grad)]
                found += [value for key, value in items
                          if isinstance(value, torch.Tensor) and rule(spec.target.device, optimizer, group, key, value)]
    return found


def on_phase(tracker: Tracker, model: nn.Module):
    def on_phase(phase: Phase) -> None:
        label_storages(tracker, model, (), phase_ended=tracker.phase)
        tracker.phase = phase

    return on_phase


def label_storages(tracker: Tracker, model: nn.Module, optimizers, phase_ended: Phase) -> None:
    """Name what a phase leaves behind: forward allocations still alive when it ends are
    activations (saved for backward, and the outputs); grads alive after backward are
    gradients; tensors in the optimizers' state are optimizer state; parameters made during the
    step are parameters (FSDP2 pads an uneven shard into a new tensor at every root forward,
    ``FSDPParam.reset_sharded_param``)."""
    if phase_ended is Phase.FORWARD:
        for key in tracker.alive_keys():
            storage = tracker.storages[key]
            forward = storage.op >= 0 and tracker.ops[storage.op].phase is Phase.FORWARD
            if forward and storage.category is Category.TEMPORARY:
                storage.category = Category.ACTIVATION
    elif phase_ended is Phase.BACKWARD:
        tracker.params_with_grad = set()
        for name, p in model.named_parameters():
            if p.grad is not None:
                tracker.params_with_grad.add(id(p))
                _relabel(tracker, p.grad, Category.GRADIENT)
                _own(tracker, p.grad, name)
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for t in tree_flatten(state)[0]:
                if isinstance(t, torch.Tensor):
                    _relabel(tracker, t, Category.OPTIMIZER_STATE)
    for p in model.parameters():
        _relabel(tracker, p, Category.PARAMETER)


def drop_state_without_grad(tracker: Tracker, optimizers: list, constructed: set[int]) -> None:
    """The warm-up gave every trainable parameter a (zero) gradient, so each has optimizer
    state; a real run creates none for a parameter that no loss reaches (``_init_group`` skips
    ``p.grad is None``: an unused pooler, a frozen branch).  Such state is not counted -- unless
    the optimizer created it when constructed (Adagrad: every parameter it is given has state)."""
    if tracker.params_with_grad is None:
        return
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in tracker.params_with_grad or id(p) in constructed:
                    continue
                for value in optimizer.state.get(p, {}).values():
                    key = tracker.key_of(value) if isinstance(value, torch.Tensor) else None
                    if key is not None and tracker.storages[key].op < 0:
                        del tracker.storages[key]


def _relabel(tracker: Tracker, t: torch.Tensor, category: Category) -> None:
    key = tracker.key_of(world.local(t))
    if key is not None and tracker.storages[key].op >= 0:
        tracker.storages[key].category = category


def name_owners(tracker: Tracker, model: nn.Module, optimizers: list) -> None:
    """``Storage.owner``: the parameter name of each parameter storage and of its optimizer
    state (gradients are named when backward ends): what sharding and pipeline stages divide by
    parameter; state the target keeps off the device (a step count on the host) names the
    optimizer ops that read it (``Tracker.host_owners``)."""
    for name, p in model.named_parameters():
        states = [optimizer.state.get(p, {}) for optimizer in optimizers]
        for t in [p, *(v for state in states for v in state.values() if isinstance(v, torch.Tensor))]:
            _own(tracker, world.local(t), name)


def _own(tracker: Tracker, t: torch.Tensor, name: str) -> None:
    key = tracker.key_of(t)
    if key is None:
        tracker.host_owners[id(t)] = name
    elif key in tracker.storages and tracker.storages[key].owner is None:
        tracker.storages[key].owner = name


@contextlib.contextmanager
def grad_order(model: nn.Module):
    """The names of the parameters in the order their ``AccumulateGrad`` ran (where DDP's reducer
    hooks in), first time each; hooks removed on exit."""
    order: dict[str, None] = {}
    handles = [
        p.register_post_accumulate_grad_hook(lambda _, name=name: order.setdefault(name))
        for name, p in model.named_parameters() if p.requires_grad
    ]
    names: list[str] = []
    try:
        yield names
    finally:
        for handle in handles:
            handle.remove()
        names += order


@contextlib.contextmanager
def module_hooks(tracker: Tracker):
    """Module paths for every op: global forward hooks, removed on exit."""
    pre = nn.modules.module.register_module_forward_pre_hook(lambda m, args: tracker.enter_module(m))
    post = nn.modules.module.register_module_forward_hook(lambda m, args, out: tracker.exit_module(m))
    try:
        yield
    finally:
        pre.remove()
        post.remove()


def model_state(model: nn.Module) -> dict[str, int]:
    """Bytes of each parameter and buffer (held tensors included) of the fake model, at the
    symbols' hints."""
    state = steps.state_tensors(model, None, ())
    return {name: hint(t.untyped_storage().nbytes())
            for category in (Category.PARAMETER, Category.BUFFER) for name, t in state[category].items()}
