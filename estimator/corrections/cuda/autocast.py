"""CUDA autocast while capturing on fake CPU tensors.

The capture runs on fake CPU tensors, so the step's ``torch.autocast("cpu", dtype)`` applies
the **CPU** op lists (``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)`` in
aten/src/ATen/autocast_mode.cpp), which differ from CUDA's: on CUDA ``layer_norm``, ``softmax``,
``exp``, ``sum``… run in fp32 and ``addmv``/``einsum``/the RNN cells in the low precision; on
the CPU ``cat``/``stack`` promote and ``cross_entropy_loss`` is cast as a whole.  ``emulate()``
makes the fake run follow CUDA's lists, for the duration of one capture:

1. **Dispatcher kernels.**  A ``torch.library.Library("aten", "IMPL")`` registers one Python
   kernel for the ``AutocastCPU`` dispatch key on every op of the union of both lists (the CPU
   set is read from this torch's dispatcher, so no CPU policy can leak in from a newer list).
   Each kernel applies the op's **CUDA** policy (``CUDA_POLICY`` below: the cast rules of
   ``WrapFunction_`` in autocast_mode.h) and calls the op again with ``AutocastCPU`` excluded,
   as the C++ wrapper's ``ExcludeDispatchKeyGuard`` does, so nested ops are not autocast.  An op
   on the CPU list only (``cat``, ``cross_entropy_loss``, ``conv2d.padding``…) has no CUDA
   kernel: its kernel redispatches to the next key with autocast still enabled for the ops it
   calls (a fallthrough: ``cross_entropy_loss`` then meets CUDA's ``log_softmax`` and
   ``nll_loss`` kernels, as on CUDA).  ``lib._destroy()`` on exit removes the registrations and
   the dispatcher falls back to the C++ kernels (nothing is left behind); the "overriding a
   previously registered kernel" warning is silenced around the registration only.
2. **The weight-cast cache** (``cached_cast`` in autocast_mode.cpp): a cast to the low
   precision of an fp32 leaf that requires grad and is not a view (a parameter) is cached for
   the autocast region: every use in the region shares one copy, alive until the region exits
   (and longer if autograd saved it).  PyTorch clears its cache in ``torch.autocast.__exit__``
   through ``torch.clear_autocast_cache()`` when the nesting returns to 0; ``emulate()`` wraps
   that function (restored on exit) to clear the emulated cache at the same moment.
3. **Substituted functions.**  The CUDA substitutes of ``estimator.corrections`` (sdpa backends,
   fused RMSNorm) run as a ``TorchFunctionMode``, above the dispatcher: they would see the
   arguments before autocast casts them (on CUDA the sdpa autocast kernel casts q, k, v and a
   float mask before the backend is chosen).  ``emulate()`` pushes an innermost mode that
   applies the CUDA policy of such a function (and the guard) before the substitute runs.
4. ``softmax``/``log_softmax`` with a half input and ``dtype=float32`` (what the fp32_set_opt_dtype
   policy passes): on CUDA ``at::native::softmax`` calls ``at::_softmax(input, dim,
   half_to_float=true)`` (SoftMax.cpp: ``if (input_.is_cuda() && input_.scalar_type() == Half &&
   dtype == Float)``): no fp32 copy of the input, and the backward's grad_input is fp16.  The
   CPU composite converts first; the kernel calls ``_softmax``/``_log_softmax`` as CUDA does.

Sources: aten/src/ATen/autocast_mode.h (pytorch/pytorch d70fe7f3, the ``AT_FORALL_*`` lists
and ``WrapFunction_``) and autocast_mode.cpp (008ec6b1: ``cached_cast``, the CUDA extras
``cudnn_convolution(_transpose)`` and the ``binary_cross_entropy`` ban, the AutocastCPU block).
The op sets were checked against torch 2.13's dispatcher (``AutocastCUDA`` kernels registered
at autocast_mode.cpp:181, ``AutocastCPU`` at :335): it adds ``rms_norm`` to fp32 (a newer
header) and has no ``Dimname`` overloads (skipped when absent); tests/test_amp.py compares.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any

import torch

from estimator.corrections.cuda import Gap
from estimator.corrections.mode import BackwardInside
from estimator.corrections.patches import patched
from estimator.vocab.categories import Target

aten = torch.ops.aten
AUTOCAST_CPU = torch._C.DispatchKey.AutocastCPU
_NO_AUTOCAST = torch._C.DispatchKeySet(AUTOCAST_CPU)

LOWER_PRECISION_FP, FP32, FP32_SET_OPT_DTYPE, FP32_APPEND_DTYPE, PROMOTE, BANNED, FALLTHROUGH = (
    "lower_precision_fp", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned", "fallthrough"
)

# -- CUDA (TORCH_LIBRARY_IMPL(aten, Autocast, m), autocast_mode.cpp; lists in autocast_mode.h) --
# AT_FORALL_LOWER_PRECISION_FP, plus KERNEL_CUDA(cudnn_convolution[_transpose], lower_precision_fp).
CUDA_LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    "cudnn_convolution", "cudnn_convolution_transpose",
)
# AT_FORALL_FP32 (+ rms_norm: torch 2.13's AutocastCUDA table, a header newer than the stored one).
CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
# AT_FORALL_FP32_SET_OPT_DTYPE.
CUDA_FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "prod.dim_Dimname", "softmax.int", "softmax.Dimname", "log_softmax.int",
    "log_softmax.Dimname", "cumprod", "cumprod.dimname", "cumsum", "cumsum.dimname", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList", "sum.dim_DimnameList",
)
# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE (fp32_append_dtype): registered overload -> redispatch target.
CUDA_FP32_APPEND_DTYPE = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
    "norm.names_ScalarOpt_dim": "norm.names_ScalarOpt_dim_dtype",
}
# AT_FORALL_PROMOTE.
CUDA_PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot",
    "scatter_add",
)
# m.impl("aten::binary_cross_entropy", binary_cross_entropy_banned).
CUDA_BANNED = ("binary_cross_entropy",)

CUDA_POLICY: dict[str, str] = {
    **dict.fromkeys(CUDA_LOWER_PRECISION_FP, LOWER_PRECISION_FP),
    **dict.fromkeys(CUDA_FP32, FP32),
    **dict.fromkeys(CUDA_FP32_SET_OPT_DTYPE, FP32_SET_OPT_DTYPE),
    **dict.fromkeys(CUDA_FP32_APPEND_DTYPE, FP32_APPEND_DTYPE),
    **dict.fromkeys(CUDA_PROMOTE, PROMOTE),
    **dict.fromkeys(CUDA_BANNED, BANNED),
}

# -- CPU (TORCH_LIBRARY_IMPL(aten, AutocastCPU, m), autocast_mode.cpp) --------------------------
# Documentation and a test's reference: emulate() reads the CPU set from the dispatcher.
CPU_LOWER_PRECISION_FP = (
    "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding", "bmm", "mm",
    "linalg_vecdot", "baddbmm", "addmm", "_addmm_activation", "addbmm", "linear", "_convolution.deprecated",
    "matmul", "conv_tbc", "mkldnn_rnn_layer", "conv_transpose1d", "conv_transpose2d.input",
    "conv_transpose3d.input", "prelu", "scaled_dot_product_attention", "_native_multi_head_attention",
)
CPU_FP32 = (
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "prod.dim_int", "prod.dim_Dimname",
    "quantile", "quantile.scalar", "nanquantile", "nanquantile.scalar", "stft", "stft.center", "cdist",
    "grid_sampler_2d", "_grid_sampler_2d_cpu_fallback", "grid_sampler_3d", "trace", "view_as_complex",
    "cholesky", "cholesky_inverse", "cholesky_solve", "inverse", "lu_solve", "orgqr", "ormqr", "pinverse",
    "max_pool3d", "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d", "reflection_pad1d", "reflection_pad2d",
    "replication_pad1d", "replication_pad2d", "replication_pad3d", "mse_loss", "cosine_embedding_loss",
    "nll_loss", "nll_loss2d", "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss", "cross_entropy_loss",
    "l1_loss", "huber_loss", "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "ctc_loss.IntList", "ctc_loss.Tensor", "kl_div", "multilabel_margin_loss",
    "binary_cross_entropy_with_logits", "fft_fft", "fft_ifft", "fft_fft2", "fft_ifft2", "fft_fftn", "fft_ifftn",
    "fft_rfft", "fft_irfft", "fft_rfft2", "fft_irfft2", "fft_rfftn", "fft_irfftn", "fft_hfft", "fft_ihfft",
    "linalg_cond", "linalg_cond.p_str", "linalg_matrix_rank", "linalg_matrix_rank.tol_tensor",
    "linalg_matrix_rank.atol_rtol_tensor", "linalg_matrix_rank.atol_rtol_float", "linalg_solve",
    "linalg_cholesky", "linalg_svdvals", "linalg_eigvals", "linalg_eigvalsh", "linalg_inv",
    "linalg_householder_product", "linalg_tensorinv", "linalg_tensorsolve", "fake_quantize_per_tensor_affine",
    "geqrf", "_lu_with_info", "qr", "svd", "triangular_solve", "fractional_max_pool2d", "fractional_max_pool3d",
    "adaptive_max_pool3d", "multilabel_margin_loss_forward", "linalg_qr", "linalg_cholesky_ex", "linalg_svd",
    "linalg_eig", "linalg_eigh", "linalg_lstsq", "linalg_inv_ex",
)
CPU_PROMOTE = ("stack", "cat", "index_copy", "index_copy.dimname")

NOT_MODELLED = (
    Gap("mixed precision on CUDA: model code that enters torch.autocast('cuda', ...) itself (e.g. an "
        "enabled=False block) or reads torch.is_autocast_enabled()/get_autocast_gpu_dtype() sees the fake "
        "run's CPU autocast state; tensors the model creates on the host are cast as if on the device"),
)

_BCE_BANNED = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)
_HALF_TO_FLOAT = {"softmax.int": aten._softmax.default, "log_softmax.int": aten._log_softmax.default}


def overload(name: str):
    """``"conv2d.padding"`` -> ``aten.conv2d.padding`` (``"mm"`` -> ``aten.mm.default``); None if
    this torch has no such overload."""
    op, _, name_of_overload = name.partition(".")
    packet = getattr(aten, op, None)
    return None if packet is None else getattr(packet, name_of_overload or "default", None)


@functools.cache
def cpu_autocast_ops() -> frozenset[str]:
    """The ops with an ``AutocastCPU`` kernel in this torch (``"mm"``, ``"conv2d.padding"``)."""
    names = (n for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::"))
    return frozenset(n[6:] for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCPU"))


def emulated_policies() -> dict[str, str]:
    """The policy of every op ``emulate()`` registers: CUDA's, or FALLTHROUGH for the CPU-only ops."""
    policies = {name: FALLTHROUGH for name in cpu_autocast_ops()}
    policies.update(CUDA_POLICY)
    return {name: policy for name, policy in policies.items() if overload(name) is not None}


# -- the cast rules (WrapFunction_ and cached_cast) ------------------------------------------------
def _eligible(t: Any) -> bool:
    """``is_eligible(arg, CUDA)``: a defined floating tensor, not double, on the device (every
    fake tensor stands for a device tensor)."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not torch.float64


class _Cache:
    """The emulated ``cached_casts`` map: source tensor id -> (source, cast)."""

    def __init__(self) -> None:
        self.casts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def cast(self, to: torch.dtype, t: Any) -> Any:
        """``cached_cast(to_type, arg, CUDA)`` (autocast_mode.cpp)."""
        if not _eligible(t) or t.dtype is to:
            return t
        cacheable = (
            to is torch.get_autocast_dtype("cpu") and t.dtype is torch.float32 and t.requires_grad and t.is_leaf
            and not t._is_view() and torch.is_autocast_cache_enabled() and not torch._C._is_cached_tensor(t)
        )
        if not cacheable:
            return t.to(to)
        hit = self.casts.get(id(t))
        if hit is None or hit[0] is not t:
            hit = self.casts[id(t)] = (t, t.to(to))
        return hit[1]


_SLOTS: dict[str, tuple[tuple[int, str, bool], ...]] = {}


def _tensor_slots(op) -> tuple[tuple[int, str, bool], ...]:
    """(position, name, is_list) of the arguments ``cached_cast`` and ``prioritize`` act on:
    ``Tensor``, ``Tensor?`` and ``Tensor[]``; not ``Tensor?[]`` (a ``c10::List<optional<Tensor>>``
    falls to the templates that return it unchanged)."""
    key = f"{op._schema.name}.{op._schema.overload_name}"
    if key in _SLOTS:
        return _SLOTS[key]
    slots = []
    for i, arg in enumerate(op._schema.arguments):
        kind = arg.type
        if isinstance(kind, torch.OptionalType):
            kind = kind.getElementType()
        if isinstance(kind, torch.TensorType):
            slots.append((i, arg.name, False))
        elif isinstance(kind, torch.ListType) and isinstance(kind.getElementType(), torch.TensorType):
            slots.append((i, arg.name, True))
    _SLOTS[key] = tuple(slots)
    return _SLOTS[key]


def _map_tensors(op, args: tuple, kwargs: dict, fn) -> tuple[tuple, dict]:
    """``fn`` on every tensor argument, the last argument first: ``(*F)(cached_cast(to, args)...)``
    leaves the order to the compiler and GCC evaluates call arguments right to left (the CPU
    build casts ``linear``'s bias, then its weight, then its input: the casts' allocation
    order, which the CUDA allocator replay sees)."""
    args, kwargs = list(args), dict(kwargs)
    for i, name, is_list in reversed(_tensor_slots(op)):
        where, key = (args, i) if i < len(args) else (kwargs, name)
        if isinstance(where, dict) and key not in where:
            continue
        value = where[key]
        where[key] = [fn(v) for v in value] if is_list and value is not None else fn(value)
    return tuple(args), kwargs


def _tensors(op, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map_tensors(op, args, kwargs, lambda v: found.append(v) or v)
    return found


def _promote_type(op, args, kwargs) -> torch.dtype:
    """``promote_type`` / ``prioritize`` (autocast_mode.h): fp32 wins over the low precision,
    doubles are ignored, another low precision is an error."""
    low = torch.get_autocast_dtype("cpu")
    current = low
    for t in _tensors(op, args, kwargs):
        if not _eligible(t):  # is_autocast_eligible fails, or a double: ignored
            continue
        if current is torch.float32 or t.dtype is torch.float32:
            current = torch.float32
        elif not (current is low and t.dtype is low):
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def _call(name: str, policy: str, op, cache: _Cache, args: tuple, kwargs: dict):
    """Run ``op`` as CUDA's autocast kernel of ``policy`` does (the caller excludes AutocastCPU)."""
    if policy in (LOWER_PRECISION_FP, FP32, PROMOTE):
        to = {LOWER_PRECISION_FP: torch.get_autocast_dtype("cpu"), FP32: torch.float32}.get(policy)
        to = _promote_type(op, args, kwargs) if to is None else to
        args, kwargs = _map_tensors(op, args, kwargs, lambda t: cache.cast(to, t))
        return op(*args, **kwargs)
    if policy == FP32_SET_OPT_DTYPE:
        return _set_opt_dtype(name, op, args, kwargs)
    if policy == FP32_APPEND_DTYPE:
        # type_from_firstarg(CUDA, kFloat, args...), appended as the target overload's dtype.
        full = [args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
                for i, a in enumerate(op._schema.arguments)]
        dtype = torch.float32 if _eligible(full[0]) else full[0].dtype
        return overload(CUDA_FP32_APPEND_DTYPE[name])(*full, dtype=dtype)
    if policy == BANNED:
        raise RuntimeError(_BCE_BANNED)
    raise AssertionError(policy)


def _set_opt_dtype(name: str, op, args: tuple, kwargs: dict):
    """``fp32_set_opt_dtype``: if the first argument is eligible, an unset ``dtype`` becomes
    float32; softmax/log_softmax then take CUDA's ``half_to_float`` path for a half input."""
    if not _eligible(args[0]):
        return op(*args, **kwargs)
    index = next(i for i, a in enumerate(op._schema.arguments) if a.name == "dtype")
    args, kwargs = list(args), dict(kwargs)
    if index < len(args):
        if args[index] is None:
            args[index] = torch.float32
        dtype = args[index]
    else:
        dtype = kwargs["dtype"] = kwargs.get("dtype") or torch.float32
    half_to_float = _HALF_TO_FLOAT.get(name)
    if half_to_float is not None and args[0].dtype is torch.float16 and dtype is torch.float32:
        dim = args[1] if len(args) > 1 else kwargs["dim"]
        return half_to_float(args[0], dim, True)
    return op(*args, **kwargs)


def _kernel(name: str, policy: str, op, cache: _Cache):
    if policy == FALLTHROUGH:
        def fallthrough(keyset, *args, **kwargs):
            return op.redispatch(keyset.remove(AUTOCAST_CPU), *args, **kwargs)

        return fallthrough

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
            return _call(name, policy, op, cache, args, kwargs)

    return kernel


class _CastBeforeSubstitutes(BackwardInside):
    """Apply CUDA's autocast policy to a substituted torch function's arguments before the
    substitute sees them, then run it (the substitute, or the op) with AutocastCPU excluded, as
    the C++ wrapper runs the op.  Active through ``backward()`` too (``BackwardInside``): a
    checkpointed block's recomputation must cast as its forward did."""

    def __init__(self, functions: dict[Any, tuple[str, str, Any]], cache: _Cache) -> None:
        super().__init__()
        self.functions, self.cache = functions, cache

    def handle(self, func, args: tuple, kwargs: dict):
        entry = self.functions.get(func)
        if entry is None or not torch.is_autocast_enabled("cpu"):
            return func(*args, **kwargs)
        name, policy, op = entry
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
            return _call(name, policy, _AsFunction(op, func), self.cache, tuple(args), kwargs)


class _AsFunction:
    """``op``'s schema (for the argument slots), called as the torch function ``func``."""

    def __init__(self, op, func) -> None:
        self._schema, self.func = op._schema, func

    def __call__(self, *args, **kwargs):
        return self.func(*args, **kwargs)


def _substituted(policies: dict[str, str]) -> dict[Any, tuple[str, str, Any]]:
    from estimator import corrections

    found = {}
    for func in corrections.substitutes(Target.CUDA):
        name = getattr(func, "__name__", "")
        policy = policies.get(name)
        if policy not in (None, FALLTHROUGH, FP32_SET_OPT_DTYPE, FP32_APPEND_DTYPE):
            found[func] = (name, policy, overload(name))
    return found


@contextlib.contextmanager
def emulate():
    """While active, ``torch.autocast("cpu", dtype)`` applies CUDA's autocast (module docstring)."""
    cache = _Cache()
    policies = emulated_policies()
    lib = torch.library.Library("aten", "IMPL")
    original_clear = torch.clear_autocast_cache

    def clear_autocast_cache() -> None:
        cache.casts.clear()
        original_clear()

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
            for name, policy in policies.items():
                lib.impl(name, _kernel(name, policy, overload(name), cache), "AutocastCPU",
                         with_keyset=policy == FALLTHROUGH)
        with patched(torch, "clear_autocast_cache", clear_autocast_cache), \
                _CastBeforeSubstitutes(_substituted(policies), cache):
            yield cache
    finally:
        cache.casts.clear()
        lib._destroy()


@contextlib.contextmanager
def device_autocast(cuda_lists: bool = True):
    """A user's own step on the CUDA target (``report(step=)``): its ``torch.autocast("cuda",
    dtype)`` regions (``torch.cuda.amp.autocast`` too) autocast the fake CPU tensors, with CUDA's
    op lists (``emulate()``, active for the block; ``cuda_lists=False``: the CPU's, for a compiled
    model, whose compiler traces autocast itself and would re-enter the emulation's kernels
    without end), and its ``torch.amp.GradScaler("cuda")`` scales as on the GPU.  Without a GPU
    both would disable themselves; autocast's default dtype is CUDA's
    (``torch.get_autocast_dtype("cuda")``: fp16).

    ``torch.amp.autocast_mode.autocast.__init__`` and ``torch.amp.GradScaler.__init__`` are
    wrapped for the block (every alias -- ``torch.autocast``, ``torch.cuda.amp.autocast``,
    ``torch.cuda.amp.GradScaler`` -- constructs through them) and restored on exit."""
    autocast, scaler = torch.amp.autocast_mode.autocast, torch.amp.GradScaler
    original_autocast, original_scaler = autocast.__init__, scaler.__init__

    def autocast_init(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        if device_type == "cuda":
            device_type, dtype = "cpu", torch.get_autocast_dtype("cuda") if dtype is None else dtype
        original_autocast(self, device_type, dtype, enabled, cache_enabled)

    def scaler_init(self, device="cuda", *args, **kwargs):
        original_scaler(self, "cpu" if device == "cuda" else device, *args, **kwargs)

    autocast.__init__, scaler.__init__ = autocast_init, scaler_init
    try:
        with emulate() if cuda_lists else contextlib.nullcontext():
            yield
    finally:
        autocast.__init__, scaler.__init__ = original_autocast, original_scaler
