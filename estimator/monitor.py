"""Live memory monitor for a real training loop: memory measured per step and per phase,
compared with fxmem's prediction, and a ``MemoryWarning`` before a predicted out-of-memory.

    rep = estimator.report(model, sample, batch=32)             # the prediction, for the GPU (optional)
    with MemoryMonitor(rep, device="cuda", budget="80GiB") as mon:
        for x, y in loader:
            mon.phase("forward", batch=len(x)); loss = loss_fn(model(x), y)
            mon.phase("backward"); loss.backward()
            mon.phase("optimizer"); opt.step(); opt.zero_grad(set_to_none=True)
            mon.step()                                          # ends the step: a StepSample
    print(mon.table())

or let hooks mark the phases and end each step: ``with MemoryMonitor(rep).attach(model, opt) as
mon:`` (a forward pre-hook on the model starts "forward" and reads the batch size from dim 0 of
its first tensor argument, a gradient hook on the model's output starts "backward", the
optimizer's step pre-hook starts "optimizer" and its post-hook ends the step).

What is measured:

- CUDA: ``torch.cuda.memory_allocated`` / ``memory_reserved`` when each phase starts, their
  peaks during it (``max_memory_allocated`` / ``max_memory_reserved``, reset at every phase
  mark, so do not rely on them elsewhere while monitoring), and at the end of each step the
  memory used on the whole device (NVML's figure, ``torch.cuda.device_memory_used``, where
  pynvml is installed; else ``total - free`` from ``cudaMemGetInfo``).
- CPU: PyTorch's CPU allocator has no counters, so the monitor keeps one: the autograd
  profiler records every allocation and free of the CPU allocator (``profile_memory``, the
  events ``validators/cpu.py`` measures with, kernel scratch included) and the monitor sums
  them.  It uses the legacy profiler entry point (no Kineto: Kineto prints two lines to stderr
  for every start and stop, and the monitor restarts it at every step so that its events do
  not pile up); the phase marks are zero-length ``record_function`` markers in the same event
  stream.  The count starts at the bytes of the model's and optimizer's tensors when
  ``attach`` is given them (parameters, gradients, buffers, optimizer state), else at 0:
  without them, CPU figures are bytes allocated since the monitor started, net of frees.
  Cost: a few microseconds per op; another profiler cannot run at the same time.

Budget checks: when a step's batch size is known (``phase(..., batch=)``, ``step(batch=)``,
the forward hook, or the prediction's own batch when the monitor starts), the prediction at
that batch is compared with ``warn_at * budget`` before the step runs; the measured figures
(the largest of peak allocated, peak reserved and device used) are compared when each phase
ends (CUDA) or when the step ends (CPU).  Each kind of warning is given once per batch size
(predicted) or once per level (measured: near, over).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from estimator.vocab.categories import Phase
from estimator.vocab.errors import InputError
from estimator.vocab.units import format_bytes, parse_bytes

START = "start"  # the part of a step before its first phase mark (data loading, …)
STEP = "step"  # the name of that part when no phase is marked at all


class MemoryWarning(UserWarning):
    """Measured or predicted memory is near (``warn_at`` × budget) or over the budget."""


@dataclass(frozen=True)
class PhaseSample:
    """One phase of one step (from its ``phase()`` mark to the next mark or the step's end)."""

    name: str
    start: int  # bytes allocated when the phase began
    peak: int  # most bytes allocated during the phase
    peak_reserved: int | None  # CUDA: most bytes the caching allocator reserved during the phase
    predicted: int | None  # the prediction's peak in this phase at the step's batch size


@dataclass(frozen=True)
class StepSample:
    """One step as measured, with the prediction at its batch size."""

    step: int  # 0, 1, …
    batch: int | None
    seconds: float  # wall time of the step, monitoring included
    peak: int  # most bytes allocated during the step
    end: int  # bytes allocated when the step ended
    peak_reserved: int | None  # CUDA: most bytes reserved during the step
    reserved: int | None  # CUDA: bytes reserved when the step ended
    device_used: int | None  # CUDA: memory used on the whole device when the step ended
    predicted: int | None  # predicted peak at ``batch`` (None without a prediction valid there)
    phases: tuple[PhaseSample, ...]

    @property
    def measured(self) -> int:
        """The figure compared with the budget: the largest of peak allocated, peak reserved and
        device used."""
        return max(v for v in (self.peak, self.peak_reserved, self.device_used) if v is not None)

    @property
    def error(self) -> float | None:
        """Signed relative error of the prediction against the measured peak allocated, in
        percent (positive: the prediction is higher)."""
        if self.predicted is None or self.peak <= 0:
            return None
        return 100.0 * (self.predicted - self.peak) / self.peak


@dataclass
class _Segment:
    name: str
    start: int = 0
    peak: int = 0
    peak_reserved: int | None = None


class _CudaSampler:
    """Allocator counters of one CUDA device."""

    kind = "cuda"

    def __init__(self, device: torch.device):
        self.device = device
        self._used = None  # the function that works for device-level used memory

    def start(self, baseline: int) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def _now(self) -> tuple[int, int]:
        return torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)

    def open(self, segment: _Segment) -> None:
        segment.start, _ = self._now()

    def close(self, segment: _Segment) -> None:
        """Fill in the peaks of the segment that ends now and start counting the next one."""
        segment.peak = torch.cuda.max_memory_allocated(self.device)
        segment.peak_reserved = torch.cuda.max_memory_reserved(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def mark(self, segment: _Segment, previous: _Segment) -> None:
        self.close(previous)
        self.open(segment)

    def end_step(self, segments: list[_Segment]) -> dict[str, int | None]:
        self.close(segments[-1])
        allocated, reserved = self._now()
        return {"end": allocated, "reserved": reserved, "device_used": self.device_used()}

    def device_used(self) -> int | None:
        if self._used is None:
            self._used = next((fn for fn in (self._nvml, self._mem_get_info) if _works(fn)), lambda: None)
        return self._used()

    def _nvml(self) -> int:
        return torch.cuda.device_memory_used(self.device)

    def _mem_get_info(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def state_bytes(self, tensors: Iterable[torch.Tensor]) -> int:
        return 0  # memory_allocated already counts them

    def stop(self) -> None:
        pass


class _CpuSampler:
    """A running count of the CPU allocator's bytes, from the profiler's allocation events."""

    kind = "cpu"
    MARKER = "fxmem.monitor#"

    def __init__(self):
        self.level = 0
        self._enabled = False
        self._marks = 0

    def _enable(self) -> None:
        from torch._C._profiler import _ExperimentalConfig
        from torch.autograd import ProfilerConfig, ProfilerState, _enable_profiler_legacy

        config = ProfilerConfig(ProfilerState.CPU, False, True, False, False, False, _ExperimentalConfig())
        try:
            _enable_profiler_legacy(config)
        except RuntimeError as exc:
            raise RuntimeError(
                f"MemoryMonitor on CPU records allocations with the autograd profiler, which is busy ({exc}): "
                "stop the other profiler first"
            ) from None
        self._enabled = True

    def _disable(self) -> list:
        from torch.autograd import _disable_profiler_legacy

        self._enabled = False
        return [event for thread in _disable_profiler_legacy() for event in thread]

    def start(self, baseline: int) -> None:
        self.level = baseline
        self._enable()

    def open(self, segment: _Segment) -> None:
        segment.start = segment.peak = self.level

    def mark(self, segment: _Segment, previous: _Segment) -> None:
        with torch.autograd.profiler.record_function(f"{self.MARKER}{self._marks}"):
            pass
        self._marks += 1

    def end_step(self, segments: list[_Segment]) -> dict[str, int | None]:
        """Replay the step's events: each marker opens the next segment."""
        events = self._disable()
        try:
            self._replay(events, segments)
        finally:
            self._enable()
        return {"end": self.level, "reserved": None, "device_used": None}

    def _replay(self, events: list, segments: list[_Segment]) -> None:
        stream = []
        for order, event in enumerate(events):
            kind = event.kind()
            if kind == "memory_alloc":
                delta = event.cpu_memory_usage()
                if delta:
                    stream.append((event.start_us(), order, delta))
            elif kind == "push" and event.name().startswith(self.MARKER):
                stream.append((event.start_us(), order, None))
        stream.sort(key=lambda item: item[:2])
        index, current = 0, segments[0]
        current.start = current.peak = self.level
        for _, _, delta in stream:
            if delta is None:  # a phase mark
                if index + 1 < len(segments):
                    index += 1
                    current = segments[index]
                    current.start = current.peak = self.level
                continue
            self.level += delta
            current.peak = max(current.peak, self.level)
        for later in segments[index + 1:]:  # marks the profiler did not see (none expected)
            later.start = later.peak = self.level
        self._marks = 0

    def state_bytes(self, tensors: Iterable[torch.Tensor]) -> int:
        storages: dict[int, int] = {}
        for t in tensors:
            if t.device.type == "cpu" and not t.is_meta:
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def stop(self) -> None:
        if self._enabled:
            self._disable()


def _works(fn) -> bool:
    """Whether ``fn()`` runs (device-level memory: pynvml may be missing, NVML unavailable)."""
    try:
        fn()
    except Exception:  # noqa: BLE001
        return False
    return True


def _state_tensors(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Parameters, their gradients, buffers (and plain tensor attributes), optimizer state."""
    from estimator.capture.steps import state_tensors

    tensors: list[torch.Tensor] = []
    if model is not None:
        for group in state_tensors(model, optimizer, ()).values():
            tensors += group.values()
        tensors += [p.grad for p in model.parameters() if p.grad is not None]
    elif optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                tensors += [p] + ([p.grad] if p.grad is not None else [])
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def _first_batch(args: Any, kwargs: Any) -> int | None:
    from torch.utils._pytree import tree_flatten

    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


class MemoryMonitor:
    """Measure memory step by step in a real loop and compare it with a prediction.

    Args:
        prediction: an ``estimator.report(...)`` of the step (optional): each step is compared
            with ``prediction.at(batch)``, each phase with the prediction's peak in that phase.
            ``estimator.report`` predicts for a GPU by default (``device="cuda"``): to monitor a
            loop on the CPU, predict with ``device="cpu"``.
        device: ``"cuda"`` (or ``"cuda:1"``, a ``torch.device``) or ``"cpu"``; default CUDA when
            available.
        budget: bytes or ``"80GiB"``; default: the CUDA device's total memory, none on CPU.
        warn_at: warn (``MemoryWarning``) when measured or predicted memory reaches this
            fraction of the budget.
        batch: the batch size of the steps when no mark says otherwise (default: the
            prediction's).
    """

    def __init__(self, prediction=None, device: str | torch.device | None = None, budget: int | str | None = None,
                 warn_at: float = 0.9, batch: int | None = None):
        if isinstance(warn_at, bool) or not isinstance(warn_at, (int, float)) or not warn_at > 0:
            raise InputError(f"warn_at must be a positive fraction of the budget, e.g. 0.9, got {warn_at!r}")
        if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0):
            raise InputError(f"batch must be a positive int, got {batch!r}")
        if prediction is not None and not hasattr(prediction, "at"):
            raise InputError(f"prediction must be an estimator Report, got {type(prediction).__name__}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise InputError("device='cuda' but torch.cuda.is_available() is False")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            self._sampler: _CudaSampler | _CpuSampler = _CudaSampler(device)
            if budget is None:
                budget = torch.cuda.get_device_properties(device).total_memory
        elif device.type == "cpu":
            self._sampler = _CpuSampler()
        else:
            raise InputError(f"device must be 'cuda' or 'cpu', got {str(device)!r}")
        self.device = device
        self.prediction = prediction
        self.budget = parse_bytes(budget) if budget is not None else None
        self.warn_at = float(warn_at)
        self.batch = batch if batch is not None else getattr(prediction, "batch", None)
        self.samples: list[StepSample] = []
        self._running = False
        self._hooks: list = []
        self._attached: tuple = (None, None)
        self._warned: set = set()
        self._phase_cache: dict[int, dict[str, int] | None] = {}
        self._reset_step()

    # -- the loop's calls ------------------------------------------------------------------

    def start(self) -> MemoryMonitor:
        """Start measuring (``with`` does it)."""
        if self._running:
            return self
        baseline = self._sampler.state_bytes(_state_tensors(*self._attached))
        self._sampler.start(baseline)
        self._running = True
        self._reset_step()
        self._check_predicted(self.batch)
        return self

    def stop(self) -> None:
        """Stop measuring; a step with phase marks that was not ended is recorded first."""
        if not self._running:
            return
        try:
            if self._marked:
                self.step()
        finally:
            self._running = False
            self._sampler.stop()
            self.detach()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def phase(self, name: str | Phase, batch: int | None = None) -> None:
        """Mark the start of a phase of the current step (``"forward"``, ``"backward"``,
        ``"optimizer"`` or any name).  ``batch``: the step's batch size, checked against the
        prediction and the budget before the phase runs.  The same name twice in a row is one
        phase."""
        self._require_running()
        name = name.value if isinstance(name, Phase) else str(name)
        if batch is not None:
            self._set_batch(batch)
        if name == self._segments[-1].name:
            return
        segment = _Segment(name)
        previous = self._segments[-1]
        self._sampler.mark(segment, previous)
        self._segments.append(segment)
        self._marked = True
        if self._sampler.kind == "cuda":
            self._check_measured(max(previous.peak, previous.peak_reserved or 0), f"phase {previous.name!r}")

    def step(self, batch: int | None = None) -> StepSample:
        """End the current step (and start the next); returns its ``StepSample``."""
        self._require_running()
        if batch is not None:
            self._set_batch(batch)
        segments = self._segments
        if not self._marked:
            segments[0].name = STEP
        totals = self._sampler.end_step(segments)
        b = self._step_batch
        per_phase = self._predicted_phases(b)
        phases = tuple(
            PhaseSample(s.name, s.start, s.peak, s.peak_reserved, per_phase.get(s.name) if per_phase else None)
            for s in segments
        )
        reserved_peaks = [p.peak_reserved for p in phases if p.peak_reserved is not None]
        sample = StepSample(
            step=len(self.samples),
            batch=b,
            seconds=time.perf_counter() - self._t0,
            peak=max(p.peak for p in phases),
            end=totals["end"],
            peak_reserved=max(reserved_peaks) if reserved_peaks else None,
            reserved=totals["reserved"],
            device_used=totals["device_used"],
            predicted=self._predicted(b),
            phases=phases,
        )
        self.samples.append(sample)
        self._check_measured(sample.measured, f"step {sample.step}", sample.predicted)
        self._reset_step()
        return sample

    # -- hooks -------------------------------------------------------------------------------

    def attach(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
               auto_step: bool = True) -> MemoryMonitor:
        """Mark phases through hooks; returns the monitor (``with MemoryMonitor(rep).attach(m, opt)``).

        The model's forward pre-hook marks "forward" (batch size: dim 0 of its first tensor
        argument); a gradient hook on the first output that requires grad marks "backward"
        (it runs once the loss's own backward reached the model's output); the optimizer's
        step pre-hook marks "optimizer".  ``auto_step``: the optimizer's step post-hook ends
        the step; without an optimizer, a forward without grad (inference) ends it.  Call it
        before the monitor starts: on CPU the count starts at the bytes of the model's and
        optimizer's tensors.  ``detach()`` (or leaving ``with``) removes the hooks.
        """
        if self._hooks:
            raise InputError("this monitor is already attached; detach() first")
        if self._running and isinstance(self._sampler, _CpuSampler):
            # tensors that existed before the monitor started are not in its count yet
            self._sampler.level += self._sampler.state_bytes(_state_tensors(model, optimizer))
        self._attached = (model, optimizer)
        if model is not None:
            def pre(module, args, kwargs):
                if self._running:
                    self.phase(Phase.FORWARD, batch=_first_batch(args, kwargs))

            def post(module, args, output):
                if not self._running:
                    return
                from torch.utils._pytree import tree_flatten

                outs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                if outs:
                    outs[0].register_hook(self._backward_hook)
                elif auto_step and optimizer is None:
                    self.step()

            self._hooks += [model.register_forward_pre_hook(pre, with_kwargs=True), model.register_forward_hook(post)]
        if optimizer is not None:
            def opt_pre(opt, args, kwargs):
                if self._running:
                    self.phase(Phase.OPTIMIZER)

            self._hooks.append(optimizer.register_step_pre_hook(opt_pre))
            if auto_step:
                def opt_post(opt, args, kwargs):
                    if self._running:
                        self.step()

                self._hooks.append(optimizer.register_step_post_hook(opt_post))
        return self

    def _backward_hook(self, grad):
        if self._running:
            self.phase(Phase.BACKWARD)

    def detach(self) -> None:
        """Remove the hooks ``attach`` added."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- results -----------------------------------------------------------------------------

    @property
    def peak(self) -> int | None:
        """The largest peak allocated over the recorded steps."""
        return max((s.peak for s in self.samples), default=None)

    def table(self) -> str:
        """The recorded steps as a text table (tabulate)."""
        from tabulate import tabulate

        cuda = self._sampler.kind == "cuda"
        headers = ["step", "batch", "peak", "predicted", "error", "at end"]
        if cuda:
            headers += ["peak reserved", "device used"]
        headers.append("time")
        rows = []
        for s in self.samples:
            row = [s.step, "" if s.batch is None else s.batch, format_bytes(s.peak),
                   "" if s.predicted is None else format_bytes(s.predicted),
                   "" if s.error is None else f"{s.error:+.2f} %", format_bytes(s.end)]
            if cuda:
                row += [format_bytes(s.peak_reserved) if s.peak_reserved is not None else "",
                        format_bytes(s.device_used) if s.device_used is not None else ""]
            row.append(f"{s.seconds * 1e3:.1f} ms")
            rows.append(row)
        title = f"fxmem monitor, device {self.device}" + (
            f", budget {format_bytes(self.budget)} (warn at {self.warn_at:.0%})" if self.budget else "")
        return title + "\n" + tabulate(rows, headers=headers, disable_numparse=True,
                                       colalign=("right",) * len(headers))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the settings, the prediction's summary and every step (bytes as ints)."""
        rep = self.prediction
        return {
            "device": str(self.device),
            "budget": self.budget,
            "warn_at": self.warn_at,
            "prediction": None if rep is None else {
                "model": rep.model, "mode": rep.mode.value, "batch": rep.batch, "peak_bytes": rep.peak_bytes,
                "peak": str(rep.peak), "device": rep.device,
            },
            "steps": [asdict(s) | {"measured": s.measured, "error_pct": s.error} for s in self.samples],
        }

    def plot(self, step: int = -1):
        """A Figure: the measured peak of every step against the prediction and the budget, and,
        with a prediction, step ``step``'s phases over the predicted timeline."""
        from estimator.reporting.plot import plot_monitor

        return plot_monitor(self, step)

    # -- internals ---------------------------------------------------------------------------

    def _require_running(self) -> None:
        if not self._running:
            raise InputError("the monitor is not running: use `with MemoryMonitor(...) as mon:` or mon.start()")

    def _reset_step(self) -> None:
        self._segments = [_Segment(START)]
        self._marked = False
        self._step_batch = self.batch
        self._t0 = time.perf_counter()
        if self._running:
            self._sampler.open(self._segments[0])

    def _set_batch(self, batch: int | None) -> None:
        if batch is None:
            return
        if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
            raise InputError(f"batch must be a positive int, got {batch!r}")
        if batch != self._step_batch:
            self._step_batch = batch
        self._check_predicted(batch)

    def _predicted(self, b: int | None) -> int | None:
        rep = self.prediction
        if rep is None or b is None:
            return None
        if b == rep.batch:
            return rep.peak_bytes
        try:
            return rep.at(b)
        except InputError:
            return None

    def _predicted_phases(self, b: int | None) -> dict[str, int] | None:
        """The prediction's peak in each phase at ``b`` (where its timeline holds)."""
        rep = self.prediction
        if rep is None or b is None or getattr(rep, "timeline", None) is None:
            return None
        if b not in self._phase_cache:
            try:
                rep.at(b)
            except InputError:
                self._phase_cache[b] = None
            else:
                from estimator.reporting.plot import timeline_in_b

                peaks: dict[str, int] = {}
                for op in timeline_in_b(rep).ops:
                    value = max(p(b) for p in op.peaks())
                    peaks[op.phase.value] = max(peaks.get(op.phase.value, 0), value)
                self._phase_cache[b] = peaks
        return self._phase_cache[b]

    def _predicted_usage(self, b: int | None) -> int | None:
        """What the budget is compared with before a step: the predicted peak, or for a CUDA
        report the predicted device memory (reserved + CUDA context, as ``max_batch`` does)."""
        rep = self.prediction
        if rep is None or b is None or getattr(rep, "cuda", None) is None:
            return self._predicted(b)
        try:
            return rep.on_device(b).device
        except InputError:
            return None

    def _check_predicted(self, b: int | None) -> None:
        predicted = self._predicted_usage(b)
        if predicted is None or self.budget is None or predicted < self.warn_at * self.budget:
            return
        key = ("predicted", b)
        if key in self._warned:
            return
        self._warned.add(key)
        over = predicted > self.budget
        fit = self.prediction.max_batch(self.budget)
        warnings.warn(
            f"fxmem: the predicted {'device memory' if getattr(self.prediction, 'cuda', None) else 'peak'} at batch "
            f"{b} is {format_bytes(predicted)}, "
            f"{predicted / self.budget:.0%} of the budget {format_bytes(self.budget)}"
            + (": the step is predicted to run out of memory" if over else "")
            + f" (largest batch that fits: {fit})",
            MemoryWarning, stacklevel=4,
        )

    def _check_measured(self, measured: int | None, where: str, predicted: int | None = None) -> None:
        if measured is None or self.budget is None or measured < self.warn_at * self.budget:
            return
        level = "over" if measured > self.budget else "near"
        if ("measured", level) in self._warned:
            return
        self._warned.add(("measured", level))
        warnings.warn(
            f"fxmem: {where} used {format_bytes(measured)}, {measured / self.budget:.0%} of the budget "
            f"{format_bytes(self.budget)} on {self.device}"
            + (f" (predicted peak {format_bytes(predicted)})" if predicted is not None else ""),
            MemoryWarning, stacklevel=3,
        )
