"""The CPU target: kernels whose memory depends on the host, measured on the host.

oneDNN chooses each convolution's implementation, and the scratchpad it books, by the CPU's
ISA (AVX2, AVX-512, AMX), its cache sizes and the thread count: byte counts fitted on one
machine were −40 % … +76 % off on another.  So the ops marked ``@measured`` in the
corrections registry are not modelled: each distinct call of the captured step (op, argument
shapes, strides and dtypes) runs once for real on this host, alone, on zero-filled tensors,
inside one ``torch.profiler`` session with ``profile_memory=True`` (every event of PyTorch's
CPU allocator, kernel scratch included; oneDNN's scratchpad comes from that allocator,
aten/src/ATen/native/mkldnn/Utils.h).  The events between the call's start and end are its
allocations: what the real outputs hold beyond the fake outputs becomes the call's
``output_bytes``, and each local maximum of the running sum above "outputs alive" one of its
``scratch`` values (``estimator.corrections.registry.Fix``).

A symbolic capture measures each call at b = 2, 3 and the requested batch (4 if that is
smaller) and fits every allocation event linearly in ``b`` (three points: fitted and
checked); where the capture's guards start its range higher (a kernel's path choice, e.g.
``use_mkldnn``'s ``N >= 16`` on a strided convolution), at the range's first two sizes
instead, so that every point measured runs the path the formula stands for.  A kernel that books other buffers at some sizes (oneDNN splits the batch over
threads differently) is measured at the requested batch + 1 too: the requested batch's regime
gives lines, exact there, the other sizes their peaks as constants below it; the report says so.  A
call too large to run at the requested batch (``MAX_CALL_FLOPS``, ``MAX_CALL_BYTES``) is
extrapolated from b = 2, 3, 4, one too large even at b = 2 is not measured, and a call the
host cannot run is not either: the report names them.  Results are cached on disk per host
(CPU model, ISA, oneDNN ISA limit, threads, torch version): ``$FXMEM_CACHE_DIR`` (default
``$XDG_CACHE_HOME/fxmem`` or ``~/.cache/fxmem``; ``FXMEM_CACHE_DIR=off`` disables it).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import platform
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sympy
import torch
from torch.utils._pytree import tree_flatten

from estimator.vocab import progress
from estimator.vocab.errors import SequenceNotSymbolic
from estimator.vocab.symbolic import as_expr
from estimator.vocab.units import GiB

log = logging.getLogger(__name__)

# A call is not run at a batch size where its real tensors (inputs) would exceed this, or its
# compute (torch.utils.flop_counter) this: about 0.1 s of fp32 on two AVX-512 cores.  The report
# says which sizes were dropped and what that leaves unmeasured.
MAX_CALL_BYTES = 2 * GiB
MAX_CALL_FLOPS = 8e9
FIT_SIZES = (2, 3)  # the small batch sizes a symbolic capture's calls are measured at (from b = 2)


def _map(fn, x):
    """``tree_map(fn, x)`` over an aten op's arguments (tuples, lists and dicts of leaves; a
    ``torch.Size`` becomes a tuple, as there), written out: a capture's measured calls are mapped
    at every batch size they are priced at."""
    if type(x) is list:
        return [_map(fn, y) for y in x]
    if type(x) in (tuple, torch.Size):
        return tuple(_map(fn, y) for y in x)
    if type(x) is dict:
        return {k: _map(fn, v) for k, v in x.items()}
    return fn(x)


def _leaves(x) -> list:
    """``tree_flatten(x)[0]`` over an aten op's arguments, written out (``_map``)."""
    if type(x) in (tuple, list, torch.Size):
        return [leaf for y in x for leaf in _leaves(y)]
    if type(x) is dict:
        return [leaf for y in x.values() for leaf in _leaves(y)]
    return [x]


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument: shape and strides (ints or sympy expressions in the capture's
    symbols) and dtype."""

    shape: tuple[Any, ...]
    stride: tuple[Any, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class KernelCall:
    """One call of a measured op in the captured step, and where its outputs went."""

    func: Any  # aten overload
    args: Any  # pytree: tensors as TensorArg, SymInts as sympy expressions
    kwargs: Any
    op: int  # index of the op in the capture
    outputs: tuple[tuple[int, Any] | None, ...]  # per flat output: (storage key, fake nbytes) if new, else None
    grad: bool = False  # run with GradMode on (a kernel that reads it: ``registry.measured(grad_mode=True)``)

    @staticmethod
    def of(func, args, kwargs, op: int, outputs: Sequence[tuple[int, Any] | None], grad: bool = False) -> KernelCall:
        def describe(x):
            if isinstance(x, torch.Tensor):
                return TensorArg(tuple(as_expr(s) for s in x.shape), tuple(as_expr(s) for s in x.stride()), x.dtype)
            if isinstance(x, torch.SymInt):
                return as_expr(x)
            return x

        return KernelCall(func, _map(describe, tuple(args)), _map(describe, dict(kwargs)), op, tuple(outputs), grad)


@dataclass(frozen=True)
class Concrete:
    """A ``KernelCall`` at one batch size: every size an int."""

    func: Any
    args: Any
    kwargs: Any
    grad: bool = False

    @functools.cached_property
    def key(self) -> str:
        return f"{self.func}|{self.args!r}|{sorted(self.kwargs.items())!r}" + ("|grad" if self.grad else "")

    def nbytes(self) -> int:
        leaves = _leaves((self.args, self.kwargs))
        return sum(_storage_numel(t.shape, t.stride) * t.dtype.itemsize for t in leaves if isinstance(t, TensorArg))

    def flops(self) -> int:
        return _flops(self.key, self)

    def affordable(self) -> bool:
        return self.nbytes() <= MAX_CALL_BYTES and self.flops() <= MAX_CALL_FLOPS

    def materialize(self):
        def real(x):
            if isinstance(x, TensorArg):
                return torch.empty_strided(x.shape, x.stride, dtype=x.dtype).zero_()
            return x

        return _map(real, self.args), _map(real, self.kwargs)


_FLOPS: dict[str, int] = {}


def _attention_flops(call: Concrete) -> int:
    """``QK^T`` and ``PV`` of the CPU flash kernel (torch.utils.flop_counter has formulas for the
    CUDA attention ops only): 4·b·h·s_q·s_kv·d forward; backward (grad_out first) 2.5 times that."""
    backward = str(call.func).endswith("_backward.default")
    q, k = [a for a in call.args if isinstance(a, TensorArg)][int(backward):int(backward) + 2]
    b, h, s_q, d = q.shape
    forward = 4 * b * h * s_q * k.shape[-2] * d
    return forward * 5 // 2 if backward else forward


_FLOPS_BY_HAND = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default": _attention_flops,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": _attention_flops,
}


def _flops(key: str, call: Concrete) -> int:
    """The call's FLOPs by torch.utils.flop_counter's formulas, run on meta tensors (by hand for
    the ops it has none for; 0 for other ops)."""
    if key not in _FLOPS and str(call.func) in _FLOPS_BY_HAND:
        _FLOPS[key] = _FLOPS_BY_HAND[str(call.func)](call)
    if key not in _FLOPS:
        from torch.utils.flop_counter import FlopCounterMode

        def meta(x):
            return torch.empty_strided(x.shape, x.stride, dtype=x.dtype, device="meta") if isinstance(x, TensorArg) else x

        try:
            with FlopCounterMode(display=False) as counter:
                call.func(*_map(meta, call.args), **_map(meta, call.kwargs))
        except Exception as exc:  # noqa: BLE001  (the op refuses these sizes: not run, named in the notes)
            _FAILED[key] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            _FLOPS[key] = math.inf
        else:
            _FLOPS[key] = counter.get_total_flops()
    return _FLOPS[key]


def _storage_numel(shape, stride) -> int:
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride))


@dataclass(frozen=True)
class Measured:
    """A call's CPU allocator events (bytes, + allocated / − freed, in order) and the bytes of
    each flat output's storage (None: no tensor, or a storage of an input)."""

    deltas: tuple[int, ...]
    outputs: tuple[int | None, ...]

    @property
    def shape(self) -> tuple:
        """What must agree for events to be fitted across batch sizes."""
        return tuple(d > 0 for d in self.deltas), tuple(o is None for o in self.outputs)


# -- the host and the cache -------------------------------------------------------------------


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The CPU's name and, where the name alone does not identify it (a virtual machine shows
    "AMD EPYC" for several generations), its family, model, stepping, cache size and a digest
    of its feature flags: kernels choose their buffers by these (oneDNN by ISA extensions and
    cache sizes), so two hosts that differ in them measure differently."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine()
    ident = [f"{key} {info[key]}" for key in ("cpu family", "model", "stepping", "cache size") if info.get(key)]
    if info.get("flags"):
        ident.append("flags " + hashlib.sha1(" ".join(sorted(info["flags"].split())).encode()).hexdigest()[:8])
    return f"{name} ({', '.join(ident)})" if ident else name


def host() -> dict[str, Any]:
    """What a measured kernel's memory depends on besides its arguments."""
    return {
        "cpu": cpu_model(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        # oneDNN reads its own limit (ONEDNN_MAX_CPU_ISA, formerly DNNL_MAX_CPU_ISA)
        "onednn_isa": os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def host_text() -> str:
    h = host()
    isa = h["isa"] + (f", ONEDNN_MAX_CPU_ISA={h['onednn_isa']}" if h["onednn_isa"] else "")
    return f"{h['cpu']}, {isa}, {h['threads']} threads, torch {h['torch']}"


def cache_dir() -> Path | None:
    value = os.environ.get("FXMEM_CACHE_DIR")
    if value is not None and value.lower() in ("", "0", "off", "none", "false"):
        return None
    if value:
        return Path(value)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fxmem"


class _Cache:
    """Measurements by call key, one JSON file per host."""

    def __init__(self):
        self.memory: dict[str, dict[str, Measured]] = {}

    def _file(self) -> Path | None:
        root = cache_dir()
        if root is None:
            return None
        h = host()
        digest = hashlib.sha1(json.dumps(h, sort_keys=True).encode()).hexdigest()[:12]
        return root / f"cpu-kernels-{h['isa']}-{h['threads']}t-{digest}.json"

    def table(self) -> dict[str, Measured]:
        path = self._file()
        key = str(path)
        if key not in self.memory:
            self.memory[key] = _read(path)
        return self.memory[key]

    def save(self) -> None:
        path = self._file()
        if path is None:
            return
        table = self.table()
        for key, measured in _read(path).items():  # what other processes (compare's workers) wrote since
            table.setdefault(key, measured)
        data = {"host": host(), "calls": {k: {"deltas": list(m.deltas), "outputs": list(m.outputs)}
                                           for k, m in table.items()}}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("could not write the kernel cache %s: %s", path, exc)


def _read(path: Path | None) -> dict[str, Measured]:
    """The measurements the cache file ``path`` holds for this host (none if it is absent, for
    another host or unreadable)."""
    if path is None or not path.exists():
        return {}
    try:
        raw = json.loads(path.read_text())
        if raw.get("host") == host():
            return {k: Measured(tuple(v["deltas"]), tuple(v["outputs"])) for k, v in raw["calls"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        log.warning("ignoring an unreadable kernel cache %s", path)
    return {}


CACHE = _Cache()


# -- measuring ---------------------------------------------------------------------------------


_FAILED: dict[str, str] = {}  # call key -> why the host could not run it (this process)


def measure(calls: Iterable[Concrete]) -> list[Measured | None]:
    """Run each call for real on this host and return its allocator events (cached); None for
    a call the host cannot run (``_FAILED`` says why)."""
    calls = list(calls)
    table = CACHE.table()
    todo = list({c.key: c for c in calls if c.key not in table and c.key not in _FAILED}.values())
    if todo:
        table.update((c.key, m) for c, m in zip(todo, _run(todo)) if m is not None)
        CACHE.save()
    return [table.get(c.key) for c in calls]


@contextlib.contextmanager
def _quiet_stderr():
    """Kineto logs each profiler start and stop on the process's stderr from C++ (USDT lines):
    not the library's to print.  File descriptor 2 goes to /dev/null while kernels are measured."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _run(calls: list[Concrete]) -> list[Measured | None]:
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    outputs: list[tuple[int | None, ...] | None] = []
    with _quiet_stderr(), torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, \
            progress.task("kernels measured on this host", total=len(calls), unit="call") as bar:
        for i, call in enumerate(calls):
            bar.update()
            args, kwargs = call.materialize()
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)}
            try:
                with torch.set_grad_enabled(call.grad), record_function(f"fxmem.kernel.{i}"):
                    out = call.func(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001  (the op rejects what the fake kernel took: named in the notes)
                _FAILED[call.key] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                outputs.append(None)
                continue
            seen = set(inputs)
            sizes = []
            for t in tree_flatten(out)[0]:
                ptr = t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None
                if ptr is None or ptr in seen:
                    sizes.append(None)
                else:
                    seen.add(ptr)
                    sizes.append(t.untyped_storage().nbytes())
            outputs.append(tuple(sizes))
            del out, args, kwargs
    windows: dict[int, tuple[int, int]] = {}
    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        elif node.name.startswith("fxmem.kernel."):
            windows[int(node.name.rsplit(".", 1)[1])] = (node.start_time_ns, node.end_time_ns)
        stack.extend(node.children)
    events.sort()
    measured: list[Measured | None] = []
    for i, sizes in enumerate(outputs):
        if sizes is None:
            measured.append(None)
            continue
        start, end = windows[i]
        measured.append(Measured(tuple(d for t, d in events if start <= t <= end), sizes))
    return measured


# -- from measurements to a Fix ---------------------------------------------------------------


@dataclass(frozen=True)
class Resolved:
    """What the measurements give one call: extra bytes per new output storage key, and its
    scratch values (ints or expressions in the batch symbol)."""

    extra: dict[int, Any]
    scratch: tuple[Any, ...]


def _peaks(m: Measured) -> tuple[list[int], int]:
    """The running sum at each local maximum, above the outputs' bytes; and what stays
    allocated after the call beyond its outputs (a cache; normally 0)."""
    out = sum(o for o in m.outputs if o is not None)
    running, peaks = 0, []
    for k, d in enumerate(m.deltas):
        running += d
        if d > 0 and (k + 1 == len(m.deltas) or m.deltas[k + 1] < 0):
            peaks.append(running - out)
    return peaks, running - out


def _extras(call: KernelCall, m: Measured, fake: dict[int, int]) -> dict[int, int]:
    extra = {}
    for pos, entry in enumerate(call.outputs):
        if entry is not None:
            real = m.outputs[pos] if pos < len(m.outputs) else None
            extra[entry[0]] = (real or 0) - fake[entry[0]]
    return extra


def _line(points: Sequence[tuple[int, int]], symbol) -> Any | None:
    """The line through ``points`` as an expression in ``symbol``; None if they are not on one."""
    (x0, y0), (x1, y1) = points[0], points[1]
    slope = sympy.Rational(y1 - y0, x1 - x0)
    if any(y != y0 + slope * (x - x0) for x, y in points[2:]):
        return None
    return sympy.expand(y0 + slope * (symbol - x0))


def fit(call: KernelCall, sizes: Sequence[int], measured: Sequence[Measured], fakes: Sequence[dict[int, int]],
        symbol) -> Resolved | None:
    """One linear formula per allocation event, if the events agree at every size."""
    if len({m.shape for m in measured}) != 1:
        return None
    peaks = [_peaks(m)[0] for m in measured]
    extras = [_extras(call, m, f) for m, f in zip(measured, fakes)]
    scratch = []
    for k in range(len(peaks[0])):
        line = _line([(b, p[k]) for b, p in zip(sizes, peaks)], symbol)
        if line is None:
            return None
        scratch.append(line)
    extra = {}
    for key in extras[0]:
        line = _line([(b, e[key]) for b, e in zip(sizes, extras)], symbol)
        if line is None:
            return None
        extra[key] = line
    return Resolved(extra, _undominated(scratch, symbol))


def _undominated(lines: list, symbol) -> tuple:
    """Drop lines another one is above everywhere (b >= 2), and lines never above 0."""
    def coeffs(e):  # e = a + c * symbol
        return e.coeff(symbol, 0), e.coeff(symbol, 1)

    items = [(e, *coeffs(sympy.sympify(e))) for e in dict.fromkeys(lines)]
    keep = []
    for e, a, c in items:
        if a + 2 * c <= 0 and c <= 0:
            continue
        if any((a2 + 2 * c2 >= a + 2 * c and c2 >= c) and (a2, c2) != (a, c) for _, a2, c2 in items):
            continue
        keep.append(e)
    return tuple(keep)


def exact(call: KernelCall, m: Measured, fake: dict[int, int]) -> Resolved:
    """The call at one batch size (a concrete capture): its largest in-kernel peak."""
    peak = max(_peaks(m)[0], default=0)
    return Resolved(_extras(call, m, fake), (peak,) if peak > 0 else ())


# -- the capture's measured calls ------------------------------------------------------------


def price(calls: Sequence[KernelCall], storages: dict, ops: Sequence, *, batch: int, symbol=None,
          values=None, valid_from: int = FIT_SIZES[0]) -> tuple[str, ...]:
    """Measure the captured ``calls`` on this host and write what they give into the capture:
    ``storages[key].extra`` for the outputs, ``ops[i].scratch`` for the kernels' buffers.

    ``symbol`` (a symbolic capture): the batch symbol the formulas are written in, and
    ``values(m)`` the substitution that puts batch ``m`` into a shape expression (None: a
    concrete capture at ``batch``), and ``valid_from`` the first batch of the capture's range.
    Returns the notes for the report.
    """
    if not calls:
        return ()
    concrete = symbol is None
    first = max(valid_from, FIT_SIZES[0])
    fit_sizes = tuple(range(first, first + len(FIT_SIZES)))  # inside the range: the formula's kernel paths
    top = max(batch, fit_sizes[-1] + 1)

    memo: dict[tuple[int, int], tuple[Concrete, dict[int, int]]] = {}  # (id(call), m) -> at(call, m)

    def at(call: KernelCall, m: int) -> tuple[Concrete, dict[int, int]]:  # each call mapped at each size once
        key = (id(call), m)
        if key not in memo:
            to_int = functools.partial(_to_int, subs={} if concrete else values(m))
            spec = Concrete(call.func, _map(lambda x: _concrete(x, to_int), call.args),
                            _map(lambda x: _concrete(x, to_int), call.kwargs), call.grad)
            memo[key] = spec, {e[0]: to_int(e[1]) for e in call.outputs if e is not None}
        return memo[key]

    def plan(call: KernelCall) -> list[int]:
        if concrete:
            return [batch] if at(call, batch)[0].affordable() else []
        small = [m for m in fit_sizes if at(call, m)[0].affordable()]
        if len(small) < len(fit_sizes):
            return []
        for m in dict.fromkeys((top, fit_sizes[-1] + 1)):  # the requested batch, else the next to check the line
            if at(call, m)[0].affordable():
                return [*small, m]
        return small

    plans = {i: plan(call) for i, call in enumerate(calls)}
    got = _measure_plan(calls, plans, at)
    irregular, capped, unmeasured, failed = [], [], [], []
    for i, call in enumerate(calls):
        sizes = plans[i]
        if not sizes:
            unmeasured.append(call)
            continue  # the fake kernel's view stays (named in the notes)
        if any(got[i][m] is None for m in sizes):
            failed.append((call, _FAILED.get(at(call, sizes[0])[0].key, "")))
            continue
        if concrete:
            resolved = exact(call, got[i][batch], at(call, batch)[1])
        else:
            if sizes[-1] != top:
                capped.append(call)
            resolved = fit(call, sizes, [got[i][m] for m in sizes], [at(call, m)[1] for m in sizes], symbol)
            if resolved is None:
                resolved = _regimes(call, got[i], at, symbol, batch if batch in got[i] else max(got[i]))
                irregular.append(call)
        for key, extra in resolved.extra.items():
            storages[key].extra = storages[key].extra + extra
        ops[call.op].scratch = tuple(ops[call.op].scratch) + tuple(resolved.scratch)
    sizes = [batch] if concrete else [*fit_sizes, top]

    def describe(call: KernelCall) -> str:  # at the smallest size measured: numbers, not symbols
        shapes = [t.shape for t in _leaves(at(call, sizes[0])[0].args) if isinstance(t, TensorArg)]
        return f"{call.func} on {shapes[0] if shapes else '()'} at b = {sizes[0]}"

    return tuple(_notes(calls, sizes, concrete, batch, irregular, capped, unmeasured, failed, describe))


def _measure_plan(calls, plans, at) -> dict[int, dict[int, Measured | None]]:
    flat = [(i, m, at(calls[i], m)[0]) for i, ms in plans.items() for m in ms]
    results = measure(c for _, _, c in flat)
    out: dict[int, dict[int, Measured | None]] = {i: {} for i in plans}
    for (i, m, _), r in zip(flat, results):
        out[i][m] = r
    return out


def _regimes(call, got: dict[int, Measured], at, symbol, requested: int) -> Resolved:
    """The events do not lie on lines (the kernel splits the batch over threads differently at
    some sizes).  The formula is made exact at the ``requested`` batch: lines through it and its
    nearest size with the same events (the largest size measured is extended by one more for
    that), plus the other sizes' peaks as constants where they stay below the requested batch's
    (so that they cannot move it); the report says the formula may be off elsewhere."""
    if requested == max(got):
        # (should the host fail here having run the requested batch, its events stand in)
        got = {**got, requested + 1: measure([at(call, requested + 1)[0]])[0] or got[requested]}
    same = [m for m in sorted(got) if got[m].shape == got[requested].shape and m != requested]
    if same:
        near = [requested, min(same, key=lambda m: (abs(m - requested), m))]
        resolved = fit(call, sorted(near), [got[m] for m in sorted(near)], [at(call, m)[1] for m in sorted(near)],
                       symbol)
    else:  # alone in its regime: its values, growing at the local slope of the peaks
        nxt = min((m for m in got if m > requested), default=None)
        here = max(_peaks(got[requested])[0], default=0)
        slope = max(max(_peaks(got[nxt])[0], default=0) - here, 0) // (nxt - requested) if nxt else 0
        resolved = exact(call, got[requested], at(call, requested)[1])
        resolved = Resolved(resolved.extra, (sympy.expand(here + slope * (symbol - requested)),))
    ceiling = max(_peaks(got[requested])[0], default=0)
    others = [p for m in got if m != requested for p in _peaks(got[m])[0] if 0 < p <= ceiling]
    return Resolved(resolved.extra, _undominated([*resolved.scratch, *others], symbol))


def _notes(calls, sizes, concrete, batch, irregular, capped, unmeasured, failed, describe) -> list[str]:
    families = sorted({str(c.func).split(".")[1] for c in calls})
    at_sizes = f"b = {batch}" if concrete else f"b = {', '.join(map(str, sizes))} (linear per allocation, checked)"
    notes = [f"{len(calls)} CPU kernel calls ({', '.join(families)}) measured on this host ({host_text()}) "
             f"at {at_sizes}"]
    if irregular:
        notes.append(f"{len(irregular)} kernel calls book other buffers at some batch sizes (the kernel splits the "
                     f"batch over threads differently), e.g. {describe(irregular[0])}: their formulas go through the "
                     "requested batch's measurement (exact there, possibly off by a few KB at other batch sizes)")
    if capped:
        notes.append(f"{len(capped)} kernel calls too large to run at b = {batch} ({MAX_CALL_FLOPS / 1e9:.0f} GFLOP / "
                     f"{MAX_CALL_BYTES / GiB:.0f} GiB per call), e.g. {describe(capped[0])}: their bytes are "
                     f"extrapolated from b = {', '.join(map(str, [*sizes[:-1], sizes[-2] + 1]))}")
    if unmeasured:
        notes.append(f"{len(unmeasured)} kernel calls NOT measured (over {MAX_CALL_FLOPS / 1e9:.0f} GFLOP or "
                     f"{MAX_CALL_BYTES / GiB:.0f} GiB at b = {sizes[0]}), e.g. {describe(unmeasured[0])}: "
                     "their in-kernel scratch is NOT counted (oneDNN's scratchpad: tens of KB per call on the "
                     "shapes measured so far; an fp32 grad_q accumulator for flash attention)")
    if failed:
        call, why = failed[0]
        notes.append(f"{len(failed)} kernel calls could not run on this host ({why}), e.g. {describe(call)}: "
                     "their in-kernel memory is NOT counted")
    return notes


def _concrete(x, to_int):
    if isinstance(x, TensorArg):
        return TensorArg(tuple(map(to_int, x.shape)), tuple(map(to_int, x.stride)), x.dtype)
    if isinstance(x, sympy.Basic):
        return to_int(x)
    return x


def _to_int(value, subs) -> int:
    if isinstance(value, int):
        return value
    value = sympy.sympify(value).xreplace(subs)
    if not value.is_Integer:  # the sequence length, or a data-dependent size
        raise SequenceNotSymbolic(f"a CPU kernel measured on the host has a size other than the batch: {value}")
    return int(value)
