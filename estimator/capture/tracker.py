"""Record every storage a step allocates and when Python/autograd really frees it.

A ``TorchDispatchMode`` sees each aten op's outputs.  A storage not seen before is an
allocation; a weak reference on it records the free at the moment the last real reference
dies (Python locals, autograd saved tensors, optimizer state…).  Views and in-place ops reuse
a storage, so they cost nothing.  The result is a list of raw events; turning them into bytes
by category is ``estimator.account``'s job.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode, _push_mode, is_traceable_wrapper_subclass

from estimator import corrections
from estimator.corrections import patches
from estimator.capture import compiled
from estimator.capture.grad_sums import GradSums
from estimator.capture.graph import GraphRecorder
from estimator.corrections.cpu.host import KernelCall
from estimator.vocab import progress
from estimator.vocab.categories import Born, Category, Phase
from estimator.vocab.symbolic import as_expr
from estimator.vocab.target import TargetSpec

# Ops that bookkeep rather than compute: never an allocation.
_SKIP = {
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
    torch.ops.prim.device.default,
}


@dataclass(slots=True)
class Storage:
    nbytes: Any  # int, or a SymInt's sympy expression in the shape-env symbols
    category: Category
    op: int  # index of the op that allocated it; -1 for state alive before the step
    extra: Any = 0  # bytes a correction adds (the real kernel's buffer beyond the meta kernel's)
    owner: str | None = None  # the parameter a parameter, gradient or optimizer-state storage belongs to
    born: Born | None = None  # state alive before the step: when it came to be in a run (None: made by the step)


@dataclass(slots=True)
class OpEvent:
    name: str  # aten overload, e.g. "aten.addmm.default"
    node: str  # the fx node recorded for this op
    phase: Phase
    module: str  # module path ("" for the root / outside any module)
    allocs: list[int] = field(default_factory=list)
    frees: list[int] = field(default_factory=list)  # freed after this op, before the next
    scratch: tuple[Any, ...] = ()  # kernel-internal bytes alive only during this op (corrections)
    kernel: KernelCall | None = None  # a call measured on the host (CPU target), priced after the capture
    owner: str | None = None  # optimizer phase: the one parameter whose tensors this op reads or writes
    # the storages of its tensor-list arguments (cat, stack, foreach ops; None for a tensor not tracked): a
    # list over the parameters or the blocks, whose length an output's size may follow (``repeated_blocks``)
    reads: tuple[int | None, ...] = ()
    # the storages of its tensor arguments (not in lists), tracked ones only: an op outside the blocks
    # that takes a block's tensor (a loop over every block's parameters at the root) is that block's work
    takes: tuple[int, ...] = ()
    stream: int = 0  # the stream it runs on, which its outputs and scratch are allocated on (0: the default)

    @property
    def op(self) -> str:
        """``name``, as ``account.OpMemory`` calls it (``account.skeleton``'s ops are these events)."""
        return self.name


RESIZE = "storage.resize_"  # the op of a storage's ``resize_()`` (``Tracker.resized``)
_RUN_AND_SAVE_RNG_STATE = torch.ops.higher_order.run_and_save_rng_state
_RNG_REGION_OPS = (_RUN_AND_SAVE_RNG_STATE, torch.ops.higher_order.run_with_rng_state)


def _storage_id(storage: torch.UntypedStorage) -> int:
    return storage._cdata


def _leaves(out) -> list:
    """An op's outputs or arguments as ``tree_flatten`` lists them (tensors, numbers, and tuples
    and lists of them), written out: it runs for every op."""
    if isinstance(out, (list, tuple)):
        return [leaf for x in out for leaf in _leaves(x)]
    return [out]


_NOT_YET = object()


def _holder(out: torch.Tensor):
    """The autograd node that keeps the wrapped number saved for ``out`` (``x * 0.5``, ``h.mul_(0.5)``):
    ``out.grad_fn`` (its ``_saved_other``); for an in-place op on a view, the ``CopySlices`` node
    autograd puts on the view's base, which holds the op's node (``rebase_history`` in
    torch/csrc/autograd/variable.cpp).  A view's own ``grad_fn`` is never read here: reading it
    regenerates it under the view's mutex and replays the view through this mode, and a read
    from inside that replay waits on the same mutex for ever.  ``_NOT_YET`` while the base's
    history is being rebased (the replay itself); None when no node keeps it."""
    if out._is_view():
        node = out._base.grad_fn
        return node if type(node).__name__ == "CopySlices" else _NOT_YET
    node = out.grad_fn
    return node if node is not None and hasattr(node, "_saved_other") else None


def _wrapper_subclass(args, kwargs) -> type | None:
    """The type of the first argument that is a tensor subclass wrapping others with its own
    ``__torch_dispatch__`` (not a fake tensor), or None (the common case: cheap)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) and is_traceable_wrapper_subclass(a):
            return type(a)
    return None


def _has_dtensor(args, kwargs) -> bool:
    """Whether an argument is a DTensor, or a list of them (a foreach op's: lists hold one kind).
    It runs for every op: nothing where torch.distributed's tensor was never imported."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:
        return False
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)) and a:
            a = a[0]
        if isinstance(a, module.DTensor):
            return True
    return False


def wrapped(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors a wrapper subclass holds, by attribute: its tensor attributes, not what its
    ``__tensor_flatten__`` names, which may read a value (torchao's float8 weight asks
    ``if self._precomputed_scale``, which a fake scale cannot answer as the real one does)."""
    return {attr: x for attr, x in vars(t).items() if isinstance(x, torch.Tensor)}


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    """``t``, or the tensors a wrapper subclass holds (``wrapped``), recursively."""
    if isinstance(t, FakeTensor) or not is_traceable_wrapper_subclass(t):
        return [t]
    return [x for inner in wrapped(t).values() for x in _inner(inner)]


class Tracker(TorchDispatchMode):
    """Records allocations and frees of storages, op by op."""

    supports_higher_order_operators = True  # a compiled region's RNG operators: ``_rng_region_op``

    ignore_compile_internals = staticmethod(compiled.transparent)  # a compiled step runs under it

    def __init__(self, module_names: dict[int, str], spec: TargetSpec | None = None):
        super().__init__()
        self.spec = spec or TargetSpec()
        self.target = self.spec.device
        self.storages: dict[int, Storage] = {}
        self._keys = itertools.count()  # keys of self.storages (an in-place gradient sum drops one)
        self.ops: list[OpEvent] = []
        self._module_stack: list[str] = []
        self._phase, self._backward_depth = Phase.FORWARD, 0
        # Storage address -> (key in self.storages, weak reference).  Addresses are reused
        # after a free, so the records are keyed by a counter instead.
        self._alive: dict[int, tuple[int, weakref.ref]] = {}
        self._pending_frees: list[int] = []
        self._module_names = module_names
        self._module_of_seq: dict[int, str] = {}  # autograd sequence nr -> module (for backward)
        self.recorder = GraphRecorder()
        self.params_with_grad: set[int] | None = None  # ids of the parameters backward gave a grad
        self.host_owners: dict[int, str] = {}  # id of optimizer state kept off the target (a step count) -> parameter
        self.freed_first: list[int] = []  # state freed before the step's first op
        self._saved: list[tuple[weakref.ref, torch.Tensor]] = []  # (output, wrapped number) to hand to its node
        self._ran: list = []  # autograd nodes holding wrapped numbers that backward just ran
        self.before_op = None  # called before each op is recorded (a user's step: finds the phase)
        self.sums = GradSums(self)
        self.bar = progress.SILENT  # the ops recorded, for a progress bar (``vocab.progress``)
        self.records_takes = False  # OpEvent.takes, for a shallow copy's capture (``repeated_blocks``) only
        self._paused = 0  # > 0 while DTensor computes output metadata (``_hooks``): nothing is recorded
        self._default_stream = torch.cpu.current_stream()
        self._streams: dict[object, int] = {}  # side streams met (``_stream``) -> their numbers
        # Storage address -> weak reference: storages in host memory on a device target (``keep_on_host``)
        self._host: dict[int, weakref.ref] = {}
        self._copying_to_host: bool | None = None  # while ``copy`` runs: where its output lives

    def __enter__(self):
        self._engine = self.sums.engine()
        self._engine.__enter__()
        self._patches = patches.patched_all(self._hooks())
        self._patches.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.__exit__(None, None, None)
            self._engine.__exit__(None, None, None)

    def _hooks(self):
        """What the tracker hooks besides the ops: storages resized in place (``resized``), and
        DTensor's sharding propagation, which runs each op it has not seen on fake tensors of
        the global shapes to learn the output's (``_sharding_prop.py``
        ``_propagate_tensor_meta_non_cached``): a real run does that on fake tensors too, and
        allocates nothing, so it is not recorded."""
        resize = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, nbytes):
            out = resize(storage, nbytes)
            self.resized(storage)
            return out

        yield torch.UntypedStorage, "resize_", resize_
        sharding = sys.modules.get("torch.distributed.tensor._sharding_prop")
        if sharding is not None:
            propagate = sharding.ShardingPropagator._propagate_tensor_meta_non_cached

            def unrecorded(*args, **kwargs):
                self._paused += 1
                try:
                    return propagate(*args, **kwargs)
                finally:
                    self._paused -= 1

            yield sharding.ShardingPropagator, "_propagate_tensor_meta_non_cached", unrecorded

    def resized(self, storage: torch.UntypedStorage) -> None:
        """``storage.resize_()`` between ops (FSDP2 frees an unsharded parameter's memory with
        ``resize_(0)`` and allocates it again with ``resize_(n)``, ``_fsdp_param.py``
        ``free_storage`` / ``alloc_storage``): its old bytes are freed where it shrinks; its new
        bytes are a storage of their own, allocated by an op of its own, ``RESIZE``."""
        entry = self._alive.pop(_storage_id(storage), None)
        if entry is not None:
            self._pending_frees.append(entry[0])
        if not storage.nbytes():
            return
        self.flush()
        self.ops.append(event := OpEvent(RESIZE, "", self.phase, self._current_module(), stream=self._stream()))
        category = Category.TEMPORARY if entry is None else self.storages[entry[0]].category
        event.allocs.append(self._track(storage, category, len(self.ops) - 1))

    # -- state alive before the step -------------------------------------------------
    def register(self, tensors: dict[str, torch.Tensor], category: Category) -> None:
        """State alive before the step, by name (the names of the graph's placeholders)."""
        for name, t in tensors.items():
            self.recorder.name(t, name)
            self._track(t.untyped_storage(), category, -1)

    def register_storages(self, storages: list[torch.UntypedStorage], category: Category) -> None:
        """State alive before the step that no tensor names (what a user's step keeps)."""
        for storage in storages:
            self._track(storage, category, -1)

    # -- host memory on a device target -----------------------------------------------
    def keep_on_host(self, tensors) -> None:
        """The storages of ``tensors`` are in host memory, not the target's (FSDP2's
        ``CPUOffloadPolicy``: ``capture/world.py`` ``Offload``): never tracked.  In the optimizer
        phase, an op whose tensors are on the host makes its outputs there (the optimizer steps on
        the CPU); elsewhere outputs are the target's but for ``copy``'s (the safe side: a host
        tensor used on the device without a copy fxmem saw is counted there).  The tensors that
        decide are the op's non-scalar ones (a CUDA kernel takes host scalars), else its scalars."""
        for t in tensors:
            storage = t.untyped_storage()
            address = _storage_id(storage)
            if address not in self._host:
                self._host[address] = weakref.ref(storage, lambda _, a=address: self._host.pop(a, None))

    def copy(self, t: torch.Tensor, to_host: bool) -> torch.Tensor:
        """A copy of ``t`` between the host and the target device (``tensor.to(device)``, which
        the capture's CPU tensors cannot make: the same device is no copy)."""
        self._copying_to_host = to_host
        try:
            out = t.clone()
        finally:
            self._copying_to_host = None
        if to_host:
            self.keep_on_host([out])
        return out

    def on_host(self, t: torch.Tensor) -> bool:
        return _storage_id(t.untyped_storage()) in self._host

    def _made_on_host(self, args, kwargs) -> bool:
        """Whether an op's outputs are in host memory (see ``keep_on_host``)."""
        if self._copying_to_host is not None:
            return self._copying_to_host
        if self.phase is not Phase.OPTIMIZER:
            return False
        tensors = [t for t in _leaves((*args, *kwargs.values())) if isinstance(t, torch.Tensor)]
        deciding = [t for t in tensors if t.dim()] or tensors  # a device op takes host scalars, not the reverse
        return bool(deciding) and all(self.on_host(t) for t in deciding)

    def alive_storages(self) -> list[torch.UntypedStorage]:
        """The storages this tracker saw allocated that are still alive."""
        return [s for s in (ref() for _, ref in self._alive.values()) if s is not None]

    def _track(self, storage: torch.UntypedStorage, category: Category, op: int, extra: Any = 0) -> int | None:
        """Start tracking ``storage``; its key, or None if it is tracked already."""
        address = _storage_id(storage)
        if address in self._alive or address in self._host:
            return None
        key = next(self._keys)
        self.storages[key] = Storage(as_expr(storage.nbytes()), category, op, as_expr(extra))
        self._alive[address] = (key, weakref.ref(storage, lambda _, a=address: self._free(a)))
        return key

    def _stream(self) -> int:
        """The stream the program is on: 0 for the default one, else its number in the order the
        capture first met it.  The capture's tensors are on the CPU, where ``torch.cpu.stream(s)``
        selects ``s`` as on CUDA (``torch/cpu/__init__.py``), so device-agnostic code that runs
        work on a side stream (FSDP2's all-gather copy-in and reduce-scatter streams,
        ``_fsdp_collectives.py``) says so here as it would on the GPU."""
        stream = torch.cpu.current_stream()
        if stream is self._default_stream:
            return 0
        return self._streams.setdefault(stream, len(self._streams) + 1)

    def _free(self, address: int) -> None:
        entry = self._alive.pop(address, None)
        if entry is not None:
            self._pending_frees.append(entry[0])

    def rename(self, new: int, old: int, since: int) -> None:
        """Storage ``new``, made by op ``since``, is ``old`` itself (an in-place gradient sum,
        ``GradSums``): its record goes, its free is ``old``'s."""
        del self.storages[new]
        for event in self.ops[since:]:
            if new in event.frees:
                event.frees[event.frees.index(new)] = old
                return
        if new in self._pending_frees:
            self._pending_frees[self._pending_frees.index(new)] = old
            return
        for address, (key, ref) in self._alive.items():
            if key == new:
                self._alive[address] = (old, ref)
                return

    def key_of(self, t: torch.Tensor) -> int | None:
        """The key of the tracked storage of ``t`` (None when not tracked)."""
        entry = self._alive.get(_storage_id(t.untyped_storage()))
        return None if entry is None else entry[0]

    def alive_keys(self) -> set[int]:
        return {key for key, _ in self._alive.values()}

    def _hand_saved(self) -> None:
        """Give each wrapped number autograd keeps (``x * 0.5``) to the node of the output it was
        saved for (its ``metadata``), and drop it when that node releases its saved variables
        (after it ran in a backward without ``retain_graph``), as the real one is.  Autograd sets
        ``grad_fn`` after the op returns and releases after the node's post hooks, so both happen
        at the next op.  An output already dead takes its number along."""
        for node in self._ran:
            try:
                node._saved_other
            except RuntimeError:  # released: "Trying to backward through the graph a second time"
                node.metadata.pop("fxmem_saved_scalars", None)
            except AttributeError:  # CopySlices: its inner node's saved variables go when it runs
                node.metadata.pop("fxmem_saved_scalars", None)
        self._ran = []
        saved, self._saved = self._saved, []
        for ref, number in saved:
            out = ref()
            node = None if out is None else _holder(out)
            if node is _NOT_YET:
                self._saved.append((ref, number))
            elif node is not None:
                if "fxmem_saved_scalars" not in node.metadata:
                    node.register_hook(lambda *_: self._ran.append(torch._C._current_autograd_node()))
                node.metadata.setdefault("fxmem_saved_scalars", []).append(number)

    def flush(self) -> None:
        """Attach frees seen since the last op to it (call when the step ends); frees before the
        first op (a user's step that starts with ``zero_grad()``) go to ``freed_first``.

        Frees between two ops happen at one point of the allocator's time (every allocation is an
        op), in an order nothing real fixes: a container's destruction order (autocast's cache of
        cast weights is a hash map of tensor pointers, ``aten/src/ATen/autocast_mode.cpp``), so
        they are kept in the order the storages were made."""
        self._hand_saved()
        pending = sorted(self._pending_frees)
        if self.ops:
            self.ops[-1].frees += pending
        else:
            self.freed_first += pending
        self._pending_frees = []

    # -- module paths -------------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self._phase

    @phase.setter
    def phase(self, phase: Phase) -> None:
        """Leaving backward drops the modules its recomputations entered and never left (a
        non-reentrant checkpoint stops its recomputation by an exception once it has what backward
        needs: the module's forward hook never runs)."""
        if phase is Phase.BACKWARD and self._phase is not Phase.BACKWARD:
            self._backward_depth = len(self._module_stack)
        elif self._phase is Phase.BACKWARD and phase is not Phase.BACKWARD:
            del self._module_stack[self._backward_depth:]
        self._phase = phase

    def enter_module(self, module: torch.nn.Module) -> None:
        self._module_stack.append(self._module_names.get(id(module), type(module).__name__))

    def exit_module(self, module: torch.nn.Module) -> None:
        if self._module_stack:
            self._module_stack.pop()

    def in_module(self) -> bool:
        """Whether a module's forward is running."""
        return bool(self._module_stack)

    def _current_module(self) -> str:
        if self.phase is Phase.BACKWARD:
            node = torch._C._current_autograd_node()
            if node is not None:
                return self._module_of_seq.get(node._sequence_nr(), "")
            return ""
        return self._module_stack[-1] if self._module_stack else ""

    def _subclass_dispatch(self, subclass: type, func, types, args, kwargs):
        """An op on a tensor subclass that wraps others (torchao's ``Float8TrainingTensor``): its own
        ``__torch_dispatch__`` runs the ops that implement it (the float8 matmul's ``_scaled_mm`` and
        the copies it makes) on the inner tensors.  The dispatcher would call it below this mode,
        which is off while its handler runs, and none of those ops would be recorded: it runs here
        with this mode pushed again, so each is recorded as any op of the step."""
        _push_mode(self)
        try:
            return subclass.__torch_dispatch__(func, types, args, kwargs)
        finally:
            _pop_mode()

    def _rng_region_op(self, func, args, kwargs):
        """Inductor's ``run_and_save_rng_state(op, *args)`` / ``run_with_rng_state(state, op,
        *args)`` (a compiled region that saves an op's randomness for checkpointing to replay,
        torch/_prims/rng_prims.py): ``op`` recorded as any op of the step, with this mode pushed
        again.  The generator state it saves is a CPU tensor kept for the backward: on the CPU
        target the CPU generator's (``torch.get_rng_state()``, 5,056 B with this torch), made where
        the op is, as an allocation of the step; on the CUDA target the CUDA generator's seed and
        offset (``torch.cuda.get_rng_state()``), host memory, not recorded."""
        save = func is _RUN_AND_SAVE_RNG_STATE
        op, rest = (args[0], args[1:]) if save else (args[1], args[2:])
        state = torch.get_rng_state() if save else None  # a real host tensor: its size is this torch's
        _push_mode(self)
        try:
            if state is not None and not self.spec.is_cuda:  # rng_prims.py's CPU impl: the state first, then the op
                state = torch.empty(state.shape, dtype=state.dtype)
            out = op(*rest, **kwargs)
        finally:
            _pop_mode()
        return out if state is None else (state, out)

    # -- the dispatch hook ---------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        if func in _RNG_REGION_OPS:
            return self._rng_region_op(func, args, kwargs)
        if _has_dtensor(args, kwargs):
            # DTensor's own dispatch (C++, ``dispatchDTensorOp``) runs the op's local ops and
            # collectives with this mode still pushed: each is recorded as any op of the step
            return NotImplemented
        kernel = corrections.fake_kernel_for(self.target, func)
        subclass = None if kernel is not None else _wrapper_subclass(args, kwargs)
        if subclass is not None:
            out = self._subclass_dispatch(subclass, func, types, args, kwargs)
        else:
            out = (kernel or func)(*args, **kwargs)
        if func in _SKIP:
            return out
        if self.before_op is not None:
            self.before_op()
        self.flush()
        module = self._current_module()
        if self.phase is Phase.FORWARD and torch.is_grad_enabled():
            # The autograd node of this op was created just before dispatch.
            self._module_of_seq.setdefault(torch._C._autograd._get_sequence_nr() - 1, module)
        fix = corrections.lookup(func, args, kwargs, out, self.spec)
        if fix.outputs is not None:
            out = fix.outputs
        event = OpEvent(str(func), self.recorder.record(func, args, kwargs, out).name, self.phase, module,
                        stream=self._stream())
        index = len(self.ops)
        self.ops.append(event)
        self.bar.update()
        leaves = _leaves(out)
        outputs = [t for t in leaves if isinstance(t, torch.Tensor)]
        if subclass is not None:  # a subclass's outputs hold the inner tensors its ops made, not storage of their own
            outputs = [x for t in outputs for x in _inner(t)]
        new = {}  # id of an output tensor whose storage this op allocated -> its key
        if (self._host or self._copying_to_host) and self._made_on_host(args, kwargs):
            self.keep_on_host(outputs)
        for i, t in enumerate(outputs):
            key = self._track(t.untyped_storage(), Category.TEMPORARY, index, fix.output_bytes.get(i, 0))
            if key is not None:
                event.allocs.append(key)
                new[id(t)] = key
        for _ in range(fix.saved_scalars) if outputs else ():
            number = torch.empty((), dtype=torch.float64)  # the wrapped Python number autograd keeps
            event.allocs.append(self._track(number.untyped_storage(), Category.TEMPORARY, index))
            self._saved.append((weakref.ref(outputs[0]), number))
        self.sums.saw(func, args, kwargs, out, index, new)
        event.scratch = tuple(as_expr(x) for x in fix.scratch)
        if fix.measure:
            event.kernel = KernelCall.of(func, args, kwargs, index, [
                (new[id(t)], self.storages[new[id(t)]].nbytes) if id(t) in new else None for t in leaves
            ], grad=fix.measure_with_grad)
        if self.phase is Phase.OPTIMIZER:
            event.owner = self._own_outputs(args, outputs, event.allocs)
        for a in args:
            if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
                event.reads += tuple(self.key_of(t) for t in a)
        if self.records_takes:
            event.takes = tuple(key for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
                                for t in _inner(a) if (key := self.key_of(t)) is not None)
        return out

    def _owner(self, t) -> str | None:
        if not isinstance(t, torch.Tensor):
            return None
        key = self.key_of(t)
        return self.host_owners.get(id(t)) if key is None else self.storages[key].owner

    def _own_outputs(self, args, outputs: list[torch.Tensor], new: list[int]) -> str | None:
        """Name the parameter an optimizer temporary is computed for: the output ``i`` of a
        foreach op belongs to the owner of element ``i`` of its first tensor list; the outputs
        of any other op to the one owner of its tensor arguments (none when they mix).  Returns
        the op's owner: that one owner (None for foreach ops and mixes)."""
        lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
        found = {self._owner(t) for t in _leaves(args)} - {None}
        single = found.pop() if len(found) == 1 and not lists else None
        if lists and len(outputs) == len(lists[0]):
            owners = [self._owner(t) for t in lists[0]]
        else:
            owners = [single] * len(outputs)
        for t, owner in zip(outputs, owners):
            key = self.key_of(t)
            if key in new and owner is not None:
                self.storages[key].owner = owner
        return single


