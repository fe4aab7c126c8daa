"""A ``torch.compile``'d step, run on fake tensors: the program the compiler really builds.

The capture compiles the fake copy of the model with the user's backend and options, and runs
it: Dynamo traces the forward (graph breaks and all, the eager pieces between compiled regions
run eagerly), AOTAutograd partitions forward and backward (its partitioner decides what is
saved and what is recomputed), and Inductor lowers, fuses and schedules each graph and writes
its wrapper: Python code that allocates every buffer (``empty_strided_cpu``), calls the kernels,
and frees each buffer at its last use (``del buf3``) or hands it to a later one
(``buf7 = buf3; del buf3  # reuse``).  All of that is compile-time work on fake tensors already
(``torch/_inductor/compile_fx.py``); only the generated kernels need real data.

So the generated wrapper runs as is, with three things swapped as its module is loaded
(``_load_fake``, patched over ``PyCodeCache.load_by_key_path``): the kernels Inductor would
compile (C++ through gcc, Triton) are no-ops and are never compiled; the buffer allocators
``empty_strided_*`` (C++ functions that bypass the dispatcher, ``torch/csrc/dynamo/guards.cpp``)
become ``torch.empty_strided``, which the fake mode and the tracker see; ``reinterpret_tensor``
becomes the ``as_strided`` view it is.  Extern kernels (``extern_kernels.mm(..., out=buf)``,
aten fallbacks) run on the fake tensors as in eager.  The tracker then sees every allocation and
free of the compiled program, with Python's own lifetimes.

Each capture compiles afresh: Dynamo's caches are reset before and after it
(``torch._dynamo.reset()``: what it remembers of earlier frames, the sizes it saw, would steer
the compile, and the fake copies must not stay in it; functions the user compiled in the same
process compile again at their next call).  While capturing, ``automatic_dynamic_shapes`` is
off unless the user's ``dynamic=`` says otherwise (a loop at one batch size compiles once, for
that size).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from estimator.capture import isolation
from estimator.corrections.patches import patched, patched_all
from estimator.vocab.errors import InputError
from estimator.vocab.strategy import COMPILE_MODES


@dataclasses.dataclass(frozen=True)
class Compiled:
    """How the step's model is compiled: ``torch.compile``'s arguments (the backend by name or
    object, ``mode``, ``options``, ``dynamic``, ``fullgraph``)."""

    backend: Any = "inductor"
    mode: str | None = None
    options: tuple[tuple[str, Any], ...] = ()  # torch.compile(options=) as (key, value) pairs: hashable
    dynamic: bool | None = None
    fullgraph: bool = False
    in_place: bool = False  # compiled by ``module.compile()``, not ``torch.compile(module)``

    def __post_init__(self) -> None:
        if isinstance(self.options, Mapping):
            object.__setattr__(self, "options", tuple(sorted(self.options.items())))
        elif self.options is None:
            object.__setattr__(self, "options", ())
        if self.mode == "default":
            object.__setattr__(self, "mode", None)
        if self.mode is not None and self.mode not in COMPILE_MODES:
            raise InputError(f"compile mode {self.mode!r} is not a torch.compile mode: {', '.join(COMPILE_MODES)}")
        if self.mode is not None and self.options:
            raise InputError("compile= takes mode or options, not both (torch.compile refuses the two together)")

    def apply(self, module: nn.Module) -> None:
        """Compile ``module``'s calls in place (its names stay its own) as the user's call does.

        ``module.compile()`` compiles ``module._call_impl``, a frame of torch/nn that Dynamo
        skips: a torch.nn module (``nn.Sequential``) compiled so runs eager, and so does its
        estimate.  ``torch.compile(module)`` gives an ``OptimizedModule``, which wraps such a
        module in a frame Dynamo captures (``external_utils.wrap_inline``, ``OptimizedModule.
        _initialize`` in torch/_dynamo/eval_frame.py): that module is compiled, here too."""
        kwargs = {"mode": self.mode} if self.mode is not None else {}
        if self.options:
            kwargs["options"] = dict(self.options)
        kwargs |= {"backend": self.backend, "dynamic": self.dynamic, "fullgraph": self.fullgraph}
        if self.in_place or not _skipped_top_frame(module):
            module.compile(**kwargs)
        else:
            from torch._dynamo import external_utils

            module._compiled_call_impl = torch.compile(external_utils.wrap_inline(module._call_impl), **kwargs)

    @property
    def autotuned(self) -> bool:
        config = dict(getattr(self.backend, "config", None) or {}) | dict(self.options)
        return bool(config.get("max_autotune")) or "autotune" in (self.mode or "")

    @property
    def program(self) -> str:
        """What runs, by backend (torch/_dynamo/backends: ``eager`` runs Dynamo's graphs as they
        are; ``aot_eager`` AOTAutograd's forward and backward graphs; a compiler its program)."""
        name = self.backend if isinstance(self.backend, str) else None
        if name == "eager":
            return ("Dynamo's graphs run eagerly, op by op (backend='eager': no AOTAutograd partition, no generated "
                    "program)")
        if name in ("aot_eager", "aot_eager_decomp_partition"):
            return ("the forward and backward graphs as AOTAutograd partitions them, run eagerly op by op "
                    f"(backend={name!r}: no generated program)")
        return ("the forward and backward graphs as AOTAutograd partitions them, the compiler's buffers and their "
                "lifetimes as its generated program allocates and frees them (its kernels are not run)")

    @property
    def label(self) -> str:
        backend = self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__",
                                                                              type(self.backend).__name__)
        parts = [f"backend={backend}"] + ([f"mode={self.mode}"] if self.mode else [])
        parts += [f"dynamic={self.dynamic}"] if self.dynamic is not None else []
        parts += [f"options={dict(self.options)}"] if self.options else []
        return ", ".join(parts)


def _skipped_top_frame(module: nn.Module) -> bool:
    """Whether Dynamo skips ``module``'s forward as a top frame (OptimizedModule's test)."""
    from torch._dynamo import config, trace_rules

    return config.wrap_top_frame or (isinstance(module.forward, types.MethodType)
                                     and bool(trace_rules.check(module.forward)))


def of(model: nn.Module) -> tuple[nn.Module, Compiled | None]:
    """The module a ``torch.compile`` of ``model`` compiles, and how (None: not compiled): an
    ``OptimizedModule`` (``torch.compile(model)``) or a module whose ``compile()`` was called.
    ``Compiled`` keeps the backend object itself (it carries ``mode`` and ``options``)."""
    if type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
        ctx, module, in_place = model.dynamo_ctx, model._orig_mod, False
    elif getattr(model, "_compiled_call_impl", None) is not None:
        cells = [c.cell_contents for c in model._compiled_call_impl.__closure__ or ()]
        ctx = next((c for c in cells if hasattr(c, "callback") and hasattr(c, "_dynamic")), None)
        module, in_place = model, True
    else:
        return model, None
    if ctx is None:
        return module, Compiled(in_place=in_place)
    backend = ctx.callback
    while hasattr(backend, "_torchdynamo_orig_backend"):  # ConvertFrame -> WrapBackendDebug -> the backend
        backend = backend._torchdynamo_orig_backend
    return module, Compiled(backend=backend, dynamic=ctx._dynamic, fullgraph=bool(ctx.fullgraph), in_place=in_place)


def eager(model: nn.Module) -> None:
    """Undo the compilation a deep copy of a compiled module carries over (its compiled call and
    an ``OptimizedModule``'s ``forward`` are bound to the user's module, not the copy)."""
    for module in model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
        if type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None), nn.Module):
            module.forward = module._orig_mod.__call__


def submodule_regions(model: nn.Module) -> None:
    """Make each ``OptimizedModule`` inside ``model`` (``torch.compile(block)`` in a job's
    parallelize function, torchtitan's per-block compile; FSDP2 may have wrapped it since) a
    compiled region of the eager step: its compiled call made again (``_initialize``) while
    ``fake_runtime(None)`` wraps what ``torch.compile`` returns.  Call it inside that block."""
    from torch._dynamo.eval_frame import OptimizedModule

    for module in model.modules():
        if isinstance(module, OptimizedModule) and module is not model:
            module._initialize()


def spec_of(compile: Any) -> Compiled | None:
    """``report(compile=...)``: False/None (eager), True (``torch.compile``'s defaults), a mode
    name, a mapping of ``torch.compile`` keyword arguments, or a ``Compiled``."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return Compiled()
    if isinstance(compile, Compiled):
        return compile
    if isinstance(compile, str):
        return Compiled(mode=compile)
    if isinstance(compile, Mapping):
        unknown = set(compile) - {f.name for f in dataclasses.fields(Compiled)}
        if unknown:
            raise InputError(f"compile= names {', '.join(sorted(unknown))}: torch.compile's arguments fxmem takes "
                             "are backend, mode, options, dynamic, fullgraph")
        return Compiled(**compile)
    raise InputError(f"compile must be True, a torch.compile mode name, or a dict of torch.compile's arguments; "
                     f"got {type(compile).__name__}")


_running = [0]  # fake_runtime()s entered and not left


def transparent() -> bool:
    """``TorchDispatchMode.ignore_compile_internals`` of fxmem's modes: while a compiled step is
    captured, Dynamo compiles under them (they are off while it compiles, on while the compiled
    program runs); otherwise Dynamo sees a mode it does not know and runs the code eagerly, as
    torch does under any user's dispatch mode."""
    return _running[0] > 0


def notes(spec) -> tuple[str, ...]:
    """What a compiled capture (``spec``: a ``StepSpec``) does not model, and how large it can be."""
    found = ["inside the compiled regions ops belong to no module (the compiler fuses across modules): the module "
             "rows count what eager code between them allocates"]
    if spec.target.is_cuda:
        found.append("the compiled program is Inductor's CPU program (C++ kernels, the capture's fake tensors are CPU "
                     "tensors): on a GPU Inductor writes Triton kernels, whose fusion, and so which intermediates "
                     "exist, can differ; that cannot be compiled without a GPU. The buffers of its plan are sized and "
                     "rounded by the CUDA allocator as eager ones are")
        if spec.precision.amp or spec.step is not None:  # amp=, or a user's step's torch.autocast("cuda")
            found.append("autocast inside the compiled region follows the CPU's autocast op lists, not CUDA's: ops "
                         "CUDA runs in low precision may be counted in fp32 (an over-estimate)")
        if spec.compiled.mode == "reduce-overhead" or dict(spec.compiled.options).get("triton.cudagraphs"):
            found.append("CUDA graphs (mode='reduce-overhead') are not modelled: their private memory pool keeps the "
                         "graph's inputs, outputs and intermediates alive between replays, up to the compiled "
                         "region's own peak on top of the estimate")
    if spec.compiled.autotuned:
        found.append("max-autotune: autotuning picks among kernel choices by timing them on real "
                     "data, which fxmem does not run: the capture takes the choice of a run whose kernels take no "
                     "time, so a choice with a workspace (a C++ GEMM template) may differ from the real run's")
    return tuple(found)


NO_GRAPH = ("torch.compile compiled no graph of this step: it ran eager and is estimated eager (Dynamo skipped its "
            "frames: a torch.nn module such as nn.Sequential compiled with module.compile() is; "
            "torch.compile(module) compiles it)")


def regions_note(found: dict[str, Any]) -> tuple[str, ...]:
    """What Dynamo made of the step (``fake_runtime``'s dict): its graphs and graph breaks."""
    graphs, breaks = found.get("graphs", 0), found.get("breaks", [])
    if not graphs:
        return (NO_GRAPH,)
    shown = "; ".join(breaks[:3]) + (f"; and {len(breaks) - 3} more" if len(breaks) > 3 else "")
    return (f"Dynamo compiled {graphs} graph(s)" + (f", with graph breaks ({shown}): the code between them ran "
                                                    "eager" if breaks else ", no graph break"),)


def eager_regions_note(found: dict[str, Any], target) -> tuple[str, ...]:
    """What the functions an eager step compiled itself became (``fake_runtime(None)``'s dict)."""
    where = (": on a GPU Inductor writes Triton kernels instead of the C++ ones of the capture's CPU program, whose "
             "fusion, and so which intermediates exist, can differ" if target.is_cuda else "")
    return (f"the step runs functions or submodules passed to torch.compile (torchao's low-bit optimizers compile "
            f"their update, a job's parallelize function its blocks): "
            f"Dynamo compiled {found['graphs']} graph(s), estimated as Inductor's program allocates their "
            f"buffers{where}",)


def _no_kernel(*args, **kwargs) -> None:
    """A generated kernel: it only writes into buffers the wrapper allocated."""


class _NoKernels:
    """``AsyncCompile``'s compilers, answering a no-op for every kernel (nothing is compiled)."""

    def cpp_pybinding(self, argtypes, source_code):
        return _no_kernel

    def cpp(self, source_code):
        return _no_kernel

    def triton(self, kernel_name, source_code, *args, **kwargs):
        return _no_kernel


def _empty_strided(size, stride, dtype, *args, **kwargs) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device="cpu")


def _reinterpret_tensor(t: torch.Tensor, size, stride, offset=0) -> torch.Tensor:
    return torch.as_strided(t, size, stride, t.storage_offset() + offset)


def _unchecked(*args, **kwargs) -> None:
    """``assert_size_stride`` / ``assert_alignment``: checks of real buffers."""


_RUNTIME = {
    "empty_strided_cpu": _empty_strided,
    "empty_strided_cuda": _empty_strided,
    "empty_strided_cpu_pinned": _empty_strided,
    "reinterpret_tensor": _reinterpret_tensor,
    "assert_size_stride": _unchecked,
    "assert_alignment": _unchecked,
}


def _load_fake(cls, key, path, linemap=None, attrs=None, *, set_sys_modules=None) -> types.ModuleType:
    """``PyCodeCache.load_by_key_path`` for a fake run: a fresh module (never Inductor's cached
    one, which real runs use), its kernels no-ops, its allocators dispatched (module docstring)."""
    from torch._inductor import async_compile

    module = types.ModuleType(f"fxmem_compiled_{key}")
    module.__file__ = path
    with open(path) as f:
        code = compile(f.read(), path, "exec")
    no_kernels = [(async_compile.AsyncCompile, name, _NoKernels.__dict__[name]) for name in ("cpp_pybinding", "cpp",
                                                                                             "triton")]
    with patched_all(no_kernels):
        exec(code, module.__dict__)
    module.__dict__.update(_RUNTIME)
    for name, value in (attrs or {}).items():
        setattr(module, name, value)
    return module


@contextlib.contextmanager
def fake_runtime(spec: Compiled | None):
    """While capturing a step: Inductor's wrappers load as ``_load_fake`` does, every capture
    compiles for itself, and shapes are static unless ``spec.dynamic`` says otherwise.  Yields a
    dict that holds, once the block is over, the graphs Dynamo compiled (``graphs``) and the
    first line of each graph break's reason (``breaks``).

    ``spec`` None: an eager step, in which only the functions it passes to ``torch.compile``
    itself are compiled regions (torchao's low-bit optimizers compile their per-parameter update
    at each ``step()``, ``fullgraph=True``): each such call runs as the real one does, compiled,
    without the capture's torch-function modes (Dynamo would trace into them) and with fxmem's
    dispatch modes transparent to the compiler (``transparent``) for its duration only; the rest
    of the step stays eager, as captured without this."""
    import torch._dynamo
    from torch._dynamo import eval_frame
    from torch._dynamo.utils import counters
    from torch._inductor import codecache
    from torch._inductor import config as inductor_config

    dynamic = spec is not None and spec.dynamic is not None
    dynamo = torch._dynamo.config.patch(
        recompile_limit=10**6, accumulated_recompile_limit=10**6,
        automatic_dynamic_shapes=bool(spec.dynamic) if dynamic else False,
    )
    # autotuning writes its timings to stderr; one compile thread: no worker pool (nothing is compiled)
    quiet = inductor_config.patch(autotune_num_choices_displayed=0, compile_threads=1)
    found: dict[str, Any] = {}
    regions = contextlib.ExitStack()
    if spec is None:
        regions.enter_context(patched(eval_frame._TorchDynamoContext, "__call__",
                                      _regions_call(eval_frame._TorchDynamoContext.__call__, found)))
        # a compiled submodule warns when global module hooks exist (fxmem's own, while capturing)
        regions.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
    else:
        _running[0] += 1
        found["reset"] = torch._dynamo.reset()  # what Dynamo remembers of earlier frames would steer this one
        counters.clear()
    # an eager step counts from here (the counters are not cleared for it)
    graphs, breaks = counters["stats"]["unique_graphs"], set(counters["graph_break"])
    try:
        with dynamo, quiet, regions, patched(codecache.PyCodeCache, "load_by_key_path", classmethod(_load_fake)):
            yield found
        found["graphs"] = counters["stats"]["unique_graphs"] - graphs
        found["breaks"] = [reason.split("\n")[0] for reason in counters["graph_break"] if reason not in breaks]
    finally:
        if "reset" in found:
            torch._dynamo.reset()  # nothing of the fake copies stays in Dynamo's caches
        _running[0] -= spec is not None


def _regions_call(call, found: dict[str, Any]):
    """``_TorchDynamoContext.__call__`` (what ``torch.compile(fn)`` returns) for an eager step:
    a compiled function runs as a compiled region (``fake_runtime``; Dynamo's caches are reset
    before the first, so that nothing compiled for real tensors runs on fake ones); modules are
    left as they are (the model's compiled modules are the step's ``Compiled``)."""

    def compile_region(self, fn):
        compiled_fn = call(self, fn)
        if isinstance(fn, nn.Module) or not callable(compiled_fn):
            return compiled_fn

        @functools.wraps(compiled_fn)
        def region(*args, **kwargs):
            if "reset" not in found:
                found["reset"] = torch._dynamo.reset()
            if getattr(self, "_dynamic", None) is not True and _symbolic(args, kwargs):
                found["symbolic"] = True  # compiled for every b at once, where the real call compiles for its own
            _running[0] += 1
            try:  # nor global module hooks (fxmem's own: Dynamo would trace them, side effects in a HOP)
                with _no_function_modes(), isolation.global_hooks_suspended():
                    return compiled_fn(*args, **kwargs)
            finally:
                _running[0] -= 1

        return region

    return compile_region


def _symbolic(args, kwargs) -> bool:
    """Whether a tensor among a compiled region's arguments has a symbolic size (the capture's
    batch or sequence symbol): Dynamo then compiles one program for every size."""
    return any(isinstance(t, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in t.shape)
               for t in torch.utils._pytree.tree_leaves((args, kwargs)))


@contextlib.contextmanager
def _no_function_modes():
    """The torch-function mode stack emptied for the block (a compiled region's: the compiler
    decomposes what the capture's substitutes stand for), restored after."""
    modes = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    try:
        yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)
