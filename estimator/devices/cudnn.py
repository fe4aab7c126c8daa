"""CUDA target: the cuDNN convolution workspace -- not modelled; bounded and reported.

The largest item the CUDA target leaves out for convolutional nets.  Each cuDNN convolution
call allocates a workspace for the engine cuDNN picks at run time and frees it when the call
returns; which engine, and so how many bytes, is cuDNN's choice (its heuristics, or timing
with ``torch.backends.cudnn.benchmark``) and no function of the shapes that PyTorch's source
states.  What the source does guarantee is a bound by the free memory; this module finds the
step's cuDNN calls in the captured graph and reports that bound per call at the report's batch
(``estimated_notes``).  No registry entry: the workspace is left out of the prediction on
purpose, and the calls, their shapes and the bytes alive at them are all in the capture's
graph and timeline already.

Sources (pytorch/pytorch, the newest stored versions; no GPU was available: nothing here is
measured):

- ``aten/src/ATen/native/cudnn/Conv_v8.cpp`` (the cuDNN v8/v9 frontend API, PyTorch's default;
  ``TORCH_CUDNN_V8_API_DISABLED=1`` selects Conv_v7.cpp).  ``run_conv_plan``: ``workspace_size =
  plan.getWorkspaceSize(); workspace_ptr = c10::cuda::CUDACachingAllocator::get()->allocate(
  workspace_size)`` -- a caching-allocator block (in ``max_memory_allocated``) held by a local
  ``DataPtr``, freed back to the cache when the call returns.  ``run_single_conv``: a plan cached
  for the shapes (``_get_benchmark_cache``, a thread-local LRU of 10,000 plans) runs first, and
  an ``OutOfMemoryError`` from its workspace is caught; else, with ``benchmark`` false, the top
  heuristic config (``get_configs_from_heuristics``: ``CUDNN_HEUR_MODE_INSTANT``, or ``_B`` with
  ``TORCH_CUDNN_V8_API_HEUR_MODE_B``), then every heuristic config, then the fallback list, each
  tried by ``try_configs``, which catches ``c10::OutOfMemoryError`` (and cuDNN errors) and moves
  on to the next config.  So a workspace that cannot be allocated never fails the call: a config
  with a smaller one runs ("GET was unable to find an engine" only when every config fails).
  With ``benchmark`` true, ``get_plans_from_find`` -> ``generate_and_filter_plans`` keeps the
  plans whose workspace is ``<= get_available_workspace()`` (``CUDACachingAllocator::cacheInfo``:
  the larger of ``cudaMemGetInfo``'s free memory and the largest free cached block), allocates
  one trial workspace of the largest kept size (halved on ``OutOfMemoryError``, dropping the
  plans that no longer fit), times every plan in it (``time_sorted_plan``, up to
  ``torch.backends.cudnn.benchmark_limit`` plans), frees it, then ``emptyCache()`` when
  ``_cudnn_get_conv_benchmark_empty_cache()`` (true by default, Convolution.cpp), and runs the
  fastest with ``try_plans`` (OOM caught the same way).
- ``aten/src/ATen/native/cudnn/Conv_v7.cpp``: the same contract.  ``AlgoIterator::try_all``
  catches ``OutOfMemoryError`` from ``allocate_workspace`` (``at::empty`` of the algorithm's
  ``perf.memory`` bytes) and tries the next algorithm; benchmark mode sizes cudnnFind's workspace
  with ``getMaxWorkspaceSize``: the largest ``cudnnGetConvolution*WorkspaceSize`` over all
  algorithms that is ``<= cacheInfo``'s largest block, then ``emptyCache()``.  Deterministic
  without benchmark: the one default algorithm (IMPLICIT_PRECOMP_GEMM / BWD_DATA_ALGO_1 /
  BWD_FILTER_ALGO_1) and its queried workspace.
- ``aten/src/ATen/native/cudnn/ConvShared.cpp``: which calls an op makes.  ``cudnn_convolution``
  allocates the output, then one forward call; ``cudnn_convolution_backward`` makes a
  backward-data call (``output_mask[0]``, grad_input allocated first) then a backward-weight
  call (``output_mask[1]``); the transposed convolution swaps forward and backward-data.  The
  bias gradient is a reduction outside cuDNN (Convolution.cpp ``convolution_backward``).
- ``aten/src/ATen/native/Convolution.cpp`` ``_select_conv_backend``: cuDNN for every CUDA
  convolution (``use_cudnn``) except depthwise ones (``is_depthwise``: 4-d/5-d, not transposed,
  ``groups == C_in > 1``, ``C_out % C_in == 0``), which go to the native CudaDepthwise2d/3d
  kernels (no workspace) unless ``use_cudnn_depthwise``: channels-last, or fp16 4-d non-dilated
  with >= 32 channels and a workload check (counted as cuDNN here: an over-count), and except
  transposed convolutions with ``output_padding >= stride``.
- ``c10/cuda/CUDACachingAllocator.cpp``: an allocation that fails first frees the cached blocks
  (``release_cached_blocks``) and retries ``cudaMalloc``; only then does it raise.  A workspace
  is therefore at most the device memory not allocated at the call (capacity, less the CUDA
  context, less what is allocated), and a failed attempt empties the cache.

``CUDNN_CONV_WSCAP_DBG`` (read by cuDNN, not PyTorch; in MiB) caps the workspace of the engines
cuDNN offers; the bound then is the smaller of the two.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any

import sympy
import torch

from estimator.corrections.registry import bind
from estimator.vocab.symbolic import Poly, as_expr
from estimator.vocab.units import MiB, format_bytes

__all__ = ["Bound", "CallKind", "ConvCall", "conv_calls", "estimated_notes", "workspace_bounds"]

aten = torch.ops.aten
# The aten ops of a convolution as the capture records them (F.conv*d / conv_transpose*d ->
# convolution; autograd's ConvolutionBackward0 -> convolution_backward).
_FORWARD = frozenset({aten.convolution.default, aten._convolution.default})
_BACKWARD = frozenset({aten.convolution_backward.default})


class CallKind(str, enum.Enum):
    """The cuDNN operation a call runs (``cudnnBackendDescriptorType_t``)."""

    FORWARD = "forward"
    BACKWARD_DATA = "backward-data"
    BACKWARD_WEIGHT = "backward-weight"


@dataclass(frozen=True)
class ConvCall:
    """One cuDNN convolution call of the step: the timeline op that makes it, and the bytes
    allocated when it starts (a lower figure: forward calls count their output, backward calls
    what was alive before the op) -- at the report's batch once evaluated."""

    op: int  # index in the timeline
    module: str
    kind: CallKind
    allocated: Poly  # bytes of the step's tensors allocated when the call starts (in b, s)


@dataclass(frozen=True)
class Bound:
    """The most a call's workspace can be, at one batch size (bytes)."""

    call: ConvCall
    allocated: int  # the call's allocated bytes plus the cuBLAS workspaces, at the batch
    bytes: int  # capacity - context - allocated (>= 0), capped by CUDNN_CONV_WSCAP_DBG when set


def _meta(node) -> Any:
    return node.meta.get("tensor_meta") if hasattr(node, "meta") else None


def _int(value) -> int | None:
    value = sympy.sympify(as_expr(value))
    return int(value) if value.is_Integer else None


def _channels_last(meta) -> bool:
    """``suggest_memory_format()`` is ChannelsLast(3d): ``is_channels_last_strides_2d/3d``
    (c10/core/MemoryFormat.h) on the recorded sizes and strides, read as sympy (no shape guard);
    a comparison a symbol leaves open answers False (the contiguous default)."""
    if meta is None or len(meta.shape) not in (4, 5):
        return False
    order = (1, 3, 2, 0) if len(meta.shape) == 4 else (1, 4, 3, 2, 0)
    smallest = 0
    for d in order:
        size, stride = sympy.sympify(as_expr(meta.shape[d])), _int(meta.stride[d])
        if stride is None or size == 0 or stride < smallest:
            return False
        if d == 0 and smallest == _int(meta.stride[1]):
            return False  # "Fallback to NCHW as default layout for ambiguous cases"
        smallest = stride
        if size != 1:
            known = _int(size)
            if known is None:
                return d == 0  # only the batch may be a symbol, and it is the last dim checked
            smallest *= known
    return True


def _cudnn_channels_last(x, w) -> bool:
    """``cudnn_conv_suggest_memory_format(input, weight)`` (ConvUtils.h) is channels-last: either
    tensor suggests it, neither is float64."""
    if x is None or w is None or torch.float64 in (x.dtype, w.dtype):
        return False
    return _channels_last(x) or _channels_last(w)


def _uses_cudnn(x, w, transposed: bool, stride, output_padding, groups) -> bool:
    """``_select_conv_backend`` on CUDA for the recorded input/weight metadata (see the module
    docstring); unknown metadata counts as cuDNN."""
    if x is None or w is None:
        return True
    if transposed and any(p >= s for p, s in zip(output_padding, stride)):
        return False  # is_output_padding_big: slow_conv_transpose, no cuDNN
    channels = as_expr(x.shape[1])
    depthwise = (not transposed and len(x.shape) in (4, 5) and isinstance(channels, int)
                 and channels == groups and groups > 1 and as_expr(w.shape[0]) % channels == 0)
    if not depthwise:
        return True
    if _cudnn_channels_last(x, w):
        return True  # use_cudnn_depthwise: "always use cudnn_depthwise for channels_last format"
    half = x.dtype == torch.float16 and w.dtype == torch.float16
    return half and len(x.shape) == 4 and channels >= 32  # + a workload check: counted as cuDNN


def _calls(func, args: dict) -> tuple[CallKind, ...]:
    """The cuDNN calls one recorded convolution op makes, in order (ConvShared.cpp)."""
    transposed = bool(args["transposed"])
    x, w = _meta(args["input"]), _meta(args["weight"])
    if func in _FORWARD:
        calls = (CallKind.BACKWARD_DATA if transposed else CallKind.FORWARD,)
    else:
        mask = args["output_mask"]
        calls = tuple(kind for kind, wanted in (
            (CallKind.FORWARD if transposed else CallKind.BACKWARD_DATA, mask[0]),
            (CallKind.BACKWARD_WEIGHT, mask[1]),
        ) if wanted)
    uses = _uses_cudnn(x, w, transposed, list(args["stride"]), list(args["output_padding"]), int(args["groups"]))
    return calls if uses else ()


def conv_calls(timeline, graph) -> tuple[ConvCall, ...]:
    """The step's cuDNN convolution calls, from the capture's graph (each op's node: arguments
    and tensor metadata) and timeline (bytes alive at each op)."""
    if graph is None:
        return ()
    nodes = {node.name: node for node in graph.nodes
             if node.op == "call_function" and (node.target in _FORWARD or node.target in _BACKWARD)}
    if not nodes:  # (a long generate() has a million ops)
        return ()
    found = []
    for op in timeline.ops:
        node = nodes.get(op.node)
        if node is None:
            continue
        kinds = _calls(node.target, bind(node.target, node.args, node.kwargs))
        before = op.total - sum(op.allocated, Poly())
        for kind in kinds:
            # Forward: the output is allocated before the call (cudnn_convolution); backward: the
            # gradients are allocated call by call, so what was alive before the op is the figure
            # that holds for both of its calls.
            found.append(ConvCall(op.index, op.module, kind, op.total if node.target in _FORWARD else before))
    return tuple(found)


def _wscap(env: str | None) -> int | None:
    """``CUDNN_CONV_WSCAP_DBG`` in bytes (MiB in the variable), None when unset or not a number."""
    try:
        return max(int(env.strip()), 0) * MiB if env is not None else None
    except ValueError:
        return None


def workspace_bounds(timeline, graph, target, batch: int, seq: int | None = None,
                     wscap_env: str | None = None) -> tuple[Bound, ...]:
    """The most each cuDNN call's workspace can be at ``batch`` on ``target`` (a CUDA
    ``TargetSpec`` with a GPU of known capacity): the device's memory less the CUDA context,
    the cuBLAS workspaces the step holds and the bytes allocated when the call starts; capped
    at ``CUDNN_CONV_WSCAP_DBG`` MiB when ``wscap_env`` gives it."""
    from estimator.devices import cuda  # estimator.devices.cuda imports estimator.corrections.cuda

    capacity = target.gpu.total_memory
    if capacity is None:
        return ()
    fixed = cuda.workspaces_held(timeline, target)
    cap = _wscap(wscap_env)
    bounds = []
    for call in conv_calls(timeline, graph):
        allocated = (call.allocated(batch, seq) if call.allocated.has_s else call.allocated(batch)) + fixed
        room = max(capacity - target.context_bytes - allocated, 0)
        bounds.append(Bound(call, allocated, room if cap is None else min(room, cap)))
    return tuple(bounds)


def _where(bound: Bound) -> str:
    return f"{bound.call.kind.value} of {bound.call.module or '(the model)'!r}"


def estimated_notes(timeline, graph, target, batch: int, seq: int | None = None, *, per_device: bool = True,
                    wscap_env: str | None = None, benchmark: bool | None = None) -> tuple[str, ...]:
    """The report's note on the cuDNN convolution workspace: empty without cuDNN calls.

    ``per_device=False`` (a distributed strategy: each rank allocates differently) leaves the
    bytes out.  ``wscap_env`` / ``benchmark`` default to this process's ``CUDNN_CONV_WSCAP_DBG``
    and ``torch.backends.cudnn.benchmark``: what the job would run with."""
    calls = conv_calls(timeline, graph)
    if not calls:
        return ()
    if wscap_env is None:
        wscap_env = os.environ.get("CUDNN_CONV_WSCAP_DBG")
    if benchmark is None:
        benchmark = bool(torch.backends.cudnn.benchmark)
    counts = ", ".join(f"{n} {kind.value}" for kind in CallKind if (n := sum(c.kind is kind for c in calls)))
    cap = _wscap(wscap_env)
    capped = (f"; CUDNN_CONV_WSCAP_DBG={wscap_env.strip()} caps the engines' workspaces at {format_bytes(cap)}"
              if cap is not None else "")
    bounds = workspace_bounds(timeline, graph, target, batch, seq, wscap_env) if per_device else ()
    if bounds:
        low, high = min(bounds, key=lambda b: b.bytes), max(bounds, key=lambda b: b.bytes)
        spread = (f"from {format_bytes(low.bytes)} ({_where(low)}) to {format_bytes(high.bytes)} ({_where(high)})"
                  if format_bytes(low.bytes) != format_bytes(high.bytes) else
                  f"{format_bytes(high.bytes)} for each call (the most: {high.bytes:,} B, {_where(high)})")
        figure = (f": at b = {batch} on the {target.gpu.name} ({format_bytes(target.gpu.total_memory)} less the "
                  f"{format_bytes(target.context_bytes)} CUDA context, the cuBLAS workspaces and the step's tensors"
                  f"{capped}) {spread}")
    elif per_device and target.gpu.total_memory is None:
        figure = f" (the GPU's capacity is unknown here: pass a GPU name for bytes{capped})"
    else:
        figure = f" (per device; not computed for each rank of a distributed strategy{capped})"
    mode = ("torch.backends.cudnn.benchmark is True here: the first call of each shape also times every engine "
            if benchmark else "With torch.backends.cudnn.benchmark=True the first call of each shape also times "
            "every engine ")
    return (
        f"cuDNN convolution workspace (not in the prediction): {len(calls)} cuDNN calls per step ({counts}); each "
        "allocates the workspace of the engine cuDNN picks through the caching allocator and frees it when the "
        "call returns (Conv_v8.cpp run_conv_plan). No shape bounds it in PyTorch's source; the free memory does: "
        "an engine whose workspace cannot be allocated is skipped for the next (try_configs / try_plans catch "
        "the OutOfMemoryError), so a call's workspace is at most the device memory not allocated when it "
        f"starts{figure}. So max_memory_allocated can exceed the prediction by the workspace of a call while it "
        "runs, never past the device's memory, and max_memory_reserved keeps its segment cached; the workspace "
        "never fails the step by itself (near the limit cuDNN takes engines with smaller workspaces: slower, "
        "not out of memory; each failed attempt first empties the allocator's cache). "
        f"{mode}in one trial workspace as large as the largest that fits the free memory "
        "(generate_and_filter_plans: halved on OOM), then empties the allocator's cache: that step's "
        "max_memory_allocated/reserved can reach the device's free memory, and the reserved memory after it "
        "differs from the prediction's replay",
    )
