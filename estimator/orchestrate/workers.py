"""The distinct captures of a ``compare`` / ``plan`` (or of a mesh's roles), in worker processes
forked from this one.

A capture is Python running the model op by op: one core.  ``capture_each`` hands the steps no
kept formula covers (``orchestrate.reuse``: one per key and hint) to worker processes forked
after every import, one per usable core at most, the longest (compiled) first: the model, the
sample and the user's functions are in each child as they are here (nothing of them is pickled),
and each child sends its ``Formula`` back pickled (``_dumps``: aten overloads by name, fx graphs
as their node lists, script objects such as a collective's process group by their class name).
The formulas are kept here, so the reports that follow find them.  A report with a mesh hands its
other roles' ranks to the workers the same way, once its first rank's capture has found them.

A child is the capture this process would run: the same torch settings and thread count (the
CPU target's corrections and host-kernel measurements follow this process's threads; the
measurements go to the shared kernel cache by read-merge-replace, ``corrections.cpu.host``),
on a thread of its own (``_capture``: OpenMP after fork), which starts with an empty context:
no progress bars (the parent's bar counts the captures).  A capture that fails in a child is
left to this process, which runs it again and raises as a report would.  Fork is POSIX-only and
unsafe on macOS (its system frameworks): there, and with ``workers=1``, everything runs here.
"""

from __future__ import annotations

import concurrent.futures
import copyreg
import dataclasses
import io
import multiprocessing
import pickle
import sys
import threading

import torch
from torch import fx

from estimator.orchestrate import reuse
from estimator.orchestrate.checked import Checked
from estimator.orchestrate.path import formula_of
from estimator.vocab import progress
from estimator.vocab.errors import InputError
from estimator.vocab.forked import usable_cores

# the captures a forked child runs, by index (set before the fork; a child reads its copy)
_PENDING: list[Checked] = []


def workers_for(workers: int | None, captures: int) -> int:
    """How many processes capture ``captures`` steps: ``workers`` (None: one per usable core),
    at most one per capture; 1 (this process) where fork is not usable."""
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise InputError(f"workers must be a whole number >= 1 (None: one per core), got {workers!r}")
    if not sys.platform.startswith("linux"):
        return 1
    return max(1, min(usable_cores() if workers is None else workers, captures))


# aten overloads, and those of ops taking script objects (``c10d::_allgather_base_``'s ProcessGroup):
# pickle's dispatch table goes by the exact type
_OVERLOADS = (torch._ops.OpOverload, torch._ops.TorchBindOpOverload)


def _reduce_op(op: torch._ops.OpOverload):
    return _op, (op._schema.name, op._overloadname)


def _op(name: str, overload: str) -> torch._ops.OpOverload:
    namespace, op = name.split("::")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A node in a pickled graph's arguments, by name."""

    name: str


def _reduce_graph(graph: fx.Graph):
    """An fx graph as a flat list of its nodes (its own pickling recurses along the node chain)."""
    def ref(arg):
        return fx.node.map_arg(arg, lambda n: _Ref(n.name))

    return _graph, ([(n.op, n.name, n.target, ref(n.args), ref(n.kwargs), n.meta) for n in graph.nodes],)


def _graph(nodes: list) -> fx.Graph:
    graph = fx.Graph()
    made: dict[str, fx.Node] = {}

    def node(arg):
        return fx.node.map_aggregate(arg, lambda x: made[x.name] if isinstance(x, _Ref) else x)

    for op, name, target, args, kwargs, meta in nodes:
        made[name] = graph.create_node(op, target, node(args), node(kwargs), name=name)
        made[name].meta = meta
    return graph


@dataclasses.dataclass(frozen=True)
class ScriptObjectRecord:
    """A script object (a collective's ``ProcessGroup`` or ``ReduceOp``) in a graph sent from a
    child: its class by name.  The graph is a record of what ran; nothing runs it again."""

    type_name: str


def _reduce_script(obj):
    return ScriptObjectRecord, (obj._type().qualified_name(),)


def _dumps(value) -> bytes:
    """``value`` pickled, aten overloads (an fx graph's targets) by their names, fx graphs flat,
    script objects as records."""
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table, fx.Graph: _reduce_graph, torch.ScriptObject: _reduce_script,
                              **{kind: _reduce_op for kind in _OVERLOADS}}
    pickler.dump(value)
    return out.getvalue()


def _capture(index: int) -> bytes:
    """In a child: the formula of ``_PENDING[index]``, pickled.

    It runs in a thread of its own: fork copies the parent's OpenMP state (GNU libgomp keeps a
    pool of threads per thread that ran a parallel region), not its threads, so a parallel kernel
    on this thread would wait for them forever.  A new thread starts a pool of its own, at the
    parent's thread count (what the CPU target's corrections and measurements follow)."""
    checked, threads, done = _PENDING[index], torch.get_num_threads(), {}

    def run() -> None:
        torch.set_num_threads(threads)
        try:
            done["formula"] = _dumps(formula_of(checked))
        except BaseException as exc:  # noqa: BLE001 - raised again on this thread, for the parent
            done["error"] = exc

    thread = threading.Thread(target=run, name="fxmem-capture")
    thread.start()
    thread.join()
    if "error" in done:
        raise done["error"]
    return done["formula"]


def capture_each(checks: list[Checked], workers: int | None = None) -> None:
    """Capture the distinct steps of ``checks`` (by key and hint: a pipeline's micro-batch is a
    hint of its own) that no kept formula covers, in forked worker processes, and keep their
    formulas (``reuse.keep``).  Captures that fail are left out."""
    todo: dict[tuple, tuple[reuse.Key, int, Checked]] = {}
    for checked in checks:
        key, hint, kept = reuse.lookup(checked)
        if key is not None and kept is None:
            todo.setdefault((key.value, hint), (key, hint, checked))
    # the longest first (a compiled step's capture compiles it): the others fill the other workers
    todo = dict(sorted(todo.items(), key=lambda item: item[1][2].spec.compiled is None))
    n = workers_for(workers, len(todo))
    if n < 2:
        return
    _PENDING[:] = [checked for _, _, checked in todo.values()]
    try:
        context = multiprocessing.get_context("fork")
        with progress.task("steps captured in worker processes", total=len(_PENDING), unit="step") as bar, \
                concurrent.futures.ProcessPoolExecutor(n, mp_context=context) as pool:
            futures = {pool.submit(_capture, i): (key, hint) for i, (key, hint, _) in enumerate(todo.values())}
            for future in concurrent.futures.as_completed(futures):
                bar.update()
                try:
                    formula_ = pickle.loads(future.result())
                except Exception:  # noqa: BLE001 - this process captures it again and raises as a report does
                    continue
                reuse.keep(*futures[future], formula_)
    finally:
        _PENDING.clear()

