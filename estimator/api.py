"""``estimator.report()``: check the inputs, capture, account, find the peak, build the Report."""

from __future__ import annotations

import bisect
import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from estimator.orchestrate import dtype_formula
from estimator.capture import steps as step
from estimator.account import CATEGORIES, Timeline
from estimator.capture import compiled, datadep
from estimator.orchestrate import path as capture_path
from estimator.capture.fake import has_row_lists, row_list_tensors, row_lists
from estimator.orchestrate.path import Captured, Formula
from estimator.capture.trace import StepSpec
from estimator.vocab.categories import Category, Mode, Phase
from estimator.devices import cudnn
from estimator.vocab.errors import CaptureError, FxmemError, InputError
from estimator.reporting.result import Generated, ModuleRow, Piece, RankReport, Report
from estimator.vocab.strategy import DEFAULT, Strategy, blocks, select
from estimator.ranks.per_rank import per_rank
from estimator.vocab.symbolic import ZERO, Poly, nondominated
from estimator.devices import cuda
from estimator.vocab import gpus
from estimator.vocab.target import target_spec
from estimator.vocab.units import as_int

DEVICES = ("cpu", "cuda")
DEFAULT_OPTIMIZER = "adamw"


def report(
    model: nn.Module,
    sample: Any,
    batch: int | None = None,
    mode: str = "train",
    optimizer: str | step.OptimizerFactory | None = DEFAULT_OPTIMIZER,
    loss_fn: step.LossFn | None = None,
    device: str = "cuda",
    gpu: str | int | None = None,
    alloc_conf: str | None = None,
    amp: str | None = None,
    grad_scaler: bool | None = None,
    dynamic: Mapping | None = None,
    strategy: Strategy | None = None,
    data_dependent: Any = "max",
    batch_dims: int | Mapping | None = None,
    step: step.StepFn | None = None,
    keep_output: bool | None = None,
    new_tokens: int | None = None,
    cache_implementation: str | None = None,
    dtype_symbols: bool = False,
    compile: Any = None,
) -> Report:
    """Predict the peak memory of one training step (or inference) of ``model`` on ``sample``.

    Nothing runs on real data: the step runs once on fake tensors with a symbolic batch size,
    so the result is a formula in ``b`` that ``Report.at`` / ``Report.max_batch`` evaluate.

    Args:
        model: the ``nn.Module`` (real or ``meta``-device weights; it is not modified, and nothing
            fake reaches the objects it or its hooks hold: see "Hooks" below).  A
            ``torch.compile``d module is estimated as compiled (``compile``); a ``torch.jit`` scripted or
            traced one cannot be captured (pass the eager module).
        sample: one example input: a tensor, a tuple (``model(*x)``) or a dict (``model(**x)``);
            dim 0 of every tensor is the batch (``batch_dims`` names another), of any size.  A list
            of dicts, one per row (DETR's ``labels``: each image's boxes, of its own size), is a row
            list: its length is the batch, its tensors keep their sizes, and other batch sizes cycle
            its rows (one capture per batch size: the model's Python loops over the rows).
        batch: the batch size to evaluate at (default: the sample's); any integer
            (``numpy.int64`` too).
        mode: ``"train"`` (forward, loss, backward, optimizer step), ``"inference"``
            (``eval()`` + ``no_grad``) or ``"generate"`` (a transformers model's
            ``model.generate(**sample, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False)``: the prefill of the prompt, then a decode step per new token; the
            KV cache is its own category, ``Report.generation`` its bytes per token); any case.
        optimizer: a name (``"sgd"``, ``"sgd-momentum"``, ``"adam"``, ``"adamw"``, …), a callable
            ``params -> Optimizer``, or None (no optimizer step).  Inference has no optimizer
            step: an optimizer other than the default is ignored there, with a note (as on the
            command line).
        loss_fn: ``loss_fn(output, sample) -> scalar``; default ``output.loss`` if present, else
            the mean of the first floating-point output.
        device: the target whose memory is predicted (a ``torch.device`` or string, any case, an
            index such as ``"cuda:1"`` allowed): ``"cuda"`` (the default): the step as CUDA runs
            it on the GPU named by ``gpu`` (attention backends, fused kernels, foreach
            optimizers), replayed through a model of the caching allocator; ``peak_bytes`` is
            then the predicted ``torch.cuda.max_memory_allocated()``, ``reserved_bytes``
            ``max_memory_reserved()``, ``device_bytes`` nvidia-smi's figure.  ``"cpu"``: the
            CPU (exact against PyTorch's CPU allocator).  No GPU is needed for either.
        gpu: CUDA only: the GPU (``"H100"``, ``"A100 80GB"``, ``"sm_90"``, or a memory size such
            as ``"24GiB"``): its architecture decides kernel choices and workspaces, its
            memory is the default budget of ``fits``/``max_batch``.  Default: an H100 (said in
            the report's first line and a note).
        alloc_conf: CUDA only: a ``PYTORCH_CUDA_ALLOC_CONF`` string (default: the
            environment's); options the allocator model cannot honour raise ``InputError``.
        amp: mixed precision: ``"fp16"`` or ``"bf16"`` (any case) runs the forward and the loss inside
            ``torch.autocast(device, dtype)`` (the target's op lists: CUDA's for
            ``device="cuda"``); None (default): no autocast.
        grad_scaler: train with ``torch.amp.GradScaler`` (``scaler.scale(loss).backward();
            scaler.step(opt); scaler.update()``; its scale and growth tracker count as optimizer
            state).  Default: True for ``amp="fp16"`` in training, else False.

        dynamic: sample dims, besides dim 0, that are the sequence length ``s``, which then
            stays a symbol: ``{"input_ids": {1: "s"}, "labels": {1: "s"}}`` for a dict sample
            (by key), ``{0: {1: "s"}}`` for a tuple (by position), ``{1: "s"}`` for a single
            tensor.  The formulas are then in ``b`` and ``s``; ``Report.at(b, s)``,
            ``max_batch(budget, s=)`` and ``max_seq(budget, b=)`` evaluate and invert them.
        strategy: an ``estimator.Strategy`` (train only, but for ``amp``): ``accumulate=k``
            splits the batch ``b`` (the optimizer step's) into ``k`` micro-batches of ``b / k``
            whose gradients accumulate (``b`` must be a multiple of ``k``; so must every ``b``
            given to ``Report.at``, and ``max_batch`` answers one); ``checkpoint=`` a module
            path, glob, tuple of them or module type whose forward is recomputed in backward
            (``torch.utils.checkpoint``, ``checkpoint_reentrant`` picks the variant);
            ``amp``/``grad_scaler`` as above; ``master_weights`` fp32 copies of a low-precision
            model's weights for the optimizer; ``data_parallel=N`` (DDP, or ``sharding=``
            ZeRO 1/2/3) and ``pipeline=S`` (``microbatches``, ``schedule``, ``split_points``)
            spread the step over devices: ``b`` is then each data-parallel rank's batch (a
            pipeline's: the pipeline's), the report is the worst device's and
            ``Report.ranks`` holds every rank's (see ``estimator.vocab.strategy.Strategy``).
        data_dependent: the sizes fake tensors cannot know (``torch.nonzero``, ``x[mask]``,
            ``masked_select``, ``unique``; ``n`` with ``0 ≤ n ≤`` the mask's elements): ``"max"``
            (default) the upper bound, the safe worst case; ``"sample"`` the sizes observed by one
            real forward of the model (real weights needed) on ``sample``, scaled per batch row; a
            fraction of the upper bound; or ``{site: n | fraction | "max" | "sample", "*": default}``
            per call site (the notes name each site: ``"<module>:<op>#<k>"``).  Where the step needs
            a data-dependent *value* (``.item()``, ``if tensor:``) the real forward gives it.
        batch_dims: the batch dimension of the sample's tensors when it is not dim 0, addressed as
            ``dynamic`` is: a plain int for every tensor (``batch_dims=1`` for a sequence-first
            ``(seq, batch, d)`` sample of ``nn.LSTM``/``nn.GRU``/``nn.Transformer*`` with
            ``batch_first=False``), or ``{key: dim}`` by dict key / tuple position (other tensors:
            dim 0).  That dim becomes ``b`` (and is what gradient accumulation splits).  Without
            it, a sequence-first module in the model gets a note.
        step: your own training step instead of the built-in one: ``step(model, sample, state)``,
            run as you wrote it (two forwards, several losses, ``clip_grad_norm_``, an EMA update,
            two optimizers, ``zero_grad`` first or with ``set_to_none=False``, ``torch.autocast``
            and a ``GradScaler`` of your own) and captured like the built-in step: one unrecorded
            step for the steady state, then the recorded one, every tensor alive across steps
            (gradients your step does not free, an EMA copy) counted before it.  ``state`` is what
            ``optimizer`` builds *from the model*: a name (``"adamw"``: that optimizer over
            ``model.parameters()``) or a callable ``model -> state`` (an optimizer, or a
            tuple/dict holding optimizers, an ``AveragedModel``, a ``GradScaler``: objects the
            step keeps between steps belong there).  With ``mode="inference"`` the model is in
            eval mode and ``state`` is None (your step chooses ``torch.no_grad``).  ``loss_fn``,
            ``amp``/``grad_scaler`` and strategies other than ``Strategy(checkpoint=...)`` and
            ``Strategy(accumulate=k)`` belong to the built-in step and are refused with ``step=``;
            with ``accumulate=k`` ``b`` is the optimizer step's batch and your step is handed all
            ``b`` rows, to split into its ``k`` micro-batches itself
            (``estimator.capture.steps.micro_batches(sample, k)``).
        keep_output: the built-in training step keeps the model's output alive through backward
            and the optimizer step (True, the default: ``out = model(x); loss = loss_fn(out, y);
            loss.backward()`` as in PyTorch's tutorials and nanoGPT) or drops it before
            ``backward()`` (False: Hugging Face's ``Trainer``, Lightning and torchtitan, whose loss
            helpers return the loss only).  A note gives the output's bytes at the peak.
        new_tokens: ``mode="generate"``: the tokens generated per sequence (required there).
        cache_implementation: ``mode="generate"``: None / ``"dynamic"`` (transformers' default
            ``DynamicCache``, grown at every step) or ``"static"`` (a ``StaticCache`` sized for
            prompt + new tokens at the prefill), as ``generate(cache_implementation=)`` takes it.
        dtype_symbols: also write the bytes in terms of the element width ``w`` of the model's float
            dtype (``Report.dtype_formula``: parameters ``Ψ·w``, Adam's state ``2Ψ·w``, fp32 master
            copies constant): the step is captured again with the model cast to fp32 (``w = 4``),
            bf16 and fp16 (``w = 2``), and each candidate peak is the line through its bytes at the
            two widths, exact at all three (fp16 gets a line of its own where its step holds other
            bytes than bf16's).  Not with ``amp`` (autocast has no second width) nor with strategies
            over several devices.
        compile: the step of the model ``torch.compile``d, estimated as the compiled program:
            ``True`` (``torch.compile``'s defaults), a mode (``"max-autotune"``, ...), or a dict of
            ``torch.compile``'s ``backend``, ``mode``, ``options``, ``dynamic``, ``fullgraph``.
            Default: as the model is (an ``OptimizedModule`` or a module whose ``compile()`` was
            called is compiled with its own settings; ``False`` estimates it eager).  Dynamo's
            graphs, AOTAutograd's partition and Inductor's generated program run on fake tensors,
            its kernels never compiled; the numbers at ``batch`` are the program compiled for that
            batch size, the formula the program for every ``b`` (see the notes).  Dynamo's caches
            are reset around the capture (functions compiled in this process compile again).

    Hooks: hooks registered on the model's modules run in the fake run, on the copy: each hook
    function is copied with the lists, dicts and sets it reaches (closure, globals), so what it
    keeps alive is counted and nothing fake lands in the user's objects.  Global module hooks
    (``register_module_forward_hook`` …) are not run during the capture (noted).  Real tensors
    the step meets that are neither the model's nor the sample's (module-level constants, a
    target ``loss_fn`` closes over) are counted -- as a buffer in the model's forward, else as
    an input (one with the sample's batch size follows ``b``) -- and named in the notes.

    Returns:
        A frozen ``Report``.

    Example:
        >>> import torch, estimator
        >>> model = torch.nn.Linear(16, 4)
        >>> rep = estimator.report(model, torch.randn(8, 16), batch=32, optimizer="sgd")  # an H100
        >>> rep.peak_bytes == rep.at(32) and rep.peak_bytes <= rep.reserved_bytes <= rep.device_bytes
        True
        >>> estimator.report(model, torch.randn(8, 16), batch=32, optimizer="sgd", device="cpu").reserved_bytes is None
        True

    Known limitations: memory must be polynomial in ``b`` (models whose batch rows interact
    through data-dependent shapes cannot be captured); sample tensors become contiguous.
    """
    request = _request(model, sample, batch, mode, optimizer, loss_fn, device, gpu, alloc_conf, amp, grad_scaler,
                       dynamic, strategy, data_dependent, batch_dims, step, keep_output, new_tokens,
                       cache_implementation, compile)
    if not isinstance(dtype_symbols, bool):
        raise InputError(f"dtype_symbols must be True or False, got {dtype_symbols!r}")
    if not dtype_symbols:
        return _with_sample_sizes(request, _result(request, _capture_step(request)))
    dtype_formula.check(request)
    formula = _capture_formula(request)

    def cast(model_, sample_, strategy_) -> _Request:  # the same arguments for the model in another dtype
        return _request(model_, sample_, batch, mode, optimizer, loss_fn, device, gpu, alloc_conf, amp, grad_scaler,
                        dynamic, strategy_, data_dependent, batch_dims, step, keep_output, new_tokens,
                        cache_implementation, compile)

    return dataclasses.replace(_result(request, _capture_step(request, formula)),
                               dtype_formula=dtype_formula.build(request, formula, cast, _capture_formula))


@dataclasses.dataclass(frozen=True)
class _Request:
    """``report()``'s arguments, checked."""

    model: nn.Module
    sample: Any
    spec: StepSpec
    batch: int
    seq_dims: dict[int, tuple[int, ...]] | None  # dynamic=: id(sample tensor) -> the dims that are s
    seq: int | None  # the sample's sequence length (dynamic=)
    optimizer_name: str | None
    notes: tuple[str, ...]  # what the checks found worth saying (the default GPU, ...)

    @property
    def strategy(self) -> Strategy:
        return self.spec.strategy

    @property
    def capture_spec(self) -> StepSpec:
        """What the capture runs: the step of one device at the batch ``b // microbatches`` (a
        pipeline's micro-batch; the per-device strategies apply to the captured step)."""
        s = self.spec.strategy
        single = Strategy(accumulate=s.accumulate, checkpoint=s.checkpoint, checkpoint_reentrant=s.checkpoint_reentrant,
                          master_weights=s.master_weights)
        return dataclasses.replace(self.spec, strategy=single)

    @property
    def microbatches(self) -> int:
        return self.strategy.microbatches or 1

    @property
    def capture_key(self) -> tuple:
        """Requests with equal keys (in one ``compare``) share the captured formulas."""
        return self.spec.precision, self.capture_spec.strategy, self.spec.keep_output, self.spec.step, self.spec.compiled


def _request(model, sample, batch, mode, optimizer, loss_fn, device, gpu, alloc_conf, amp, grad_scaler, dynamic,
             strategy, data_dependent="max", batch_dims=None, user_step=None, keep_output=None, new_tokens=None,
             cache_implementation=None, compile=None) -> _Request:
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
        user_step = generation
    device_ = _device(device)
    if loss_fn is not None and not callable(loss_fn):
        raise InputError(f"loss_fn must be callable (output, sample) -> scalar, got {type(loss_fn).__name__}")
    seq_dims, seq = _seq_dims(sample, dynamic, dims)
    target, target_notes = target_spec(device_, gpu, alloc_conf)
    notes = [*target_notes, *notes]
    _check_user_step(user_step, loss_fn, amp, grad_scaler, strategy, keep_output)
    if user_step is not None:
        factory = step.state_factory(optimizer) if mode_ is Mode.TRAIN else None
    else:
        factory = step.optimizer_factory(optimizer) if mode_ is Mode.TRAIN else None
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
    precision = step.Precision.of(amp, grad_scaler, mode_)
    spec = StepSpec(mode_, factory, loss_fn or step.default_loss, target, precision, strategy,
                    datadep.Policy.of(data_dependent), dims, keep_output is not False, user_step, compiled_as)
    if mode_ is Mode.TRAIN and optimizer is None:
        notes.append("optimizer=None: no optimizer step and no optimizer state")
    if mode_ is not Mode.TRAIN and optimizer is not None and optimizer != DEFAULT_OPTIMIZER:
        notes.append(f"optimizer={_optimizer_name(optimizer)!r} is ignored: inference has no optimizer step")
    if batch_dims is None:
        notes.extend(_sequence_first(model))
    if generation is not None:
        notes.append(f"the step is {generation}: the prefill of the prompt, then {generation.new_tokens - 1} decode "
                     "step(s), each a call of the model on the last token with the cache")
    elif user_step is not None:
        notes.append(f"the step is yours ({_optimizer_name(user_step)}), captured as it ran; its phases were found "
                     "from its backward() and optimizer.step() calls (ops after a backward outside any module call, "
                     "such as clipping or an EMA update, count as the optimizer phase)")
    name = _optimizer_name(optimizer) if mode_ is Mode.TRAIN else None
    return _Request(model, sample, spec, batch, seq_dims, seq, name, tuple(notes))


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
    # its k micro-batches' rows and splits them itself (step.micro_batches); the capture's symbol
    # is the micro-batch, so the formulas stay polynomial in b.
    if strategy is not None and isinstance(strategy, Strategy) and (
            dataclasses.replace(strategy, checkpoint=None, checkpoint_reentrant=False, accumulate=1) != DEFAULT):
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
    inner = [path for path, m in model.named_modules() if path and compiled.of(m)[1] is not None]
    if inner:
        notes.append(f"module {inner[0]!r} is compiled with torch.compile: estimated as eager (fxmem compiles the "
                     "whole model only: pass compile= or the model torch.compile returned)")
    return model, compiled_as


def _mode(mode) -> Mode:
    try:
        return Mode(mode.lower() if isinstance(mode, str) else mode)
    except ValueError:
        raise InputError(f"mode must be 'train', 'inference' or 'generate', got {mode!r}") from None


def _generation(model: nn.Module, sample: Any, mode: Mode, user_step, new_tokens,
                cache_implementation) -> step.Generation | None:
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
    if cache_implementation not in step.CACHE_IMPLEMENTATIONS:
        raise InputError(f"cache_implementation must be one of {step.CACHE_IMPLEMENTATIONS}, got "
                         f"{cache_implementation!r}")
    return step.Generation(n, cache_implementation)


def _device(device) -> str:
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
    dtypes = {p.dtype for p in step.trainable(model) if p.is_floating_point()}
    if not dtypes - {torch.float32, torch.float64}:
        raise InputError("Strategy(master_weights=True) keeps fp32 copies of low-precision parameters, but the "
                         f"model's are {', '.join(sorted(str(d) for d in dtypes)) or 'not floating point'}: "
                         "cast it first (model.to(torch.bfloat16))")
    return step.master_weights(factory)


def _precision_of(strategy: Strategy, amp, grad_scaler):
    """``report(amp=, grad_scaler=)`` or the strategy's (they must agree when both are given)."""
    for name, given, own in (("amp", amp, strategy.amp), ("grad_scaler", grad_scaler, strategy.grad_scaler)):
        if given is not None and own is not None and given != own:
            raise InputError(f"report({name}={given!r}) and Strategy({name}={own!r}) disagree: give one")
    return (amp if amp is not None else strategy.amp,
            grad_scaler if grad_scaler is not None else strategy.grad_scaler)


def _result(request: _Request, step_: Captured) -> Report:
    """The report of ``request`` from its captured step: one device's, or every rank's."""
    spec, strategy, model, batch = request.spec, request.strategy, request.model, request.batch
    notes = [*request.notes, *step_.notes]
    if spec.target.is_cuda:  # what is not modelled, and the estimated items with their size
        ran = {op.op for op in step_.timeline.ops} | {site.op for site in step_.data_dependent}
        notes += [cuda.not_modelled_note(ran), *gpus.estimated_notes(spec.target.context_bytes),
                  *cudnn.estimated_notes(step_.at_batch or step_.timeline, step_.graph, spec.target, batch,
                                         step_.seq, per_device=not strategy.distributed)]
    if strategy.multiple > 1:
        notes.append(_batch_note(strategy))
    if spec.mode is Mode.TRAIN and spec.step is None and spec.keep_output:
        notes.extend(_kept_output_note(step_.at_batch, batch))
    common = {
        "model": type(model).__name__,
        "mode": spec.mode,
        "device": spec.target.device.value,
        "optimizer": request.optimizer_name,
        "batch": batch,
        "path": step_.path,
        "valid_from": step_.valid_from,
        "valid_to": step_.valid_to,
        "guards": step_.guards,
        "graph": step_.graph,
        "batch_outside_range": step_.outside,
        "target": spec.target,
        "seq": step_.seq,
        "seq_range": step_.seq_range or (2, None),
        "multiple": strategy.multiple,
        "strategy": strategy,
        "data_dependent": step_.data_dependent,
    }
    if spec.mode is Mode.GENERATE:
        prompt = step_.seq if step_.seq is not None else request.sample["input_ids"].shape[-1]
        common["generation"] = _generated(spec.step, step_.at_batch or step_.timeline, batch, prompt)
        notes.append(_generated_note(common["generation"], batch))
    if not strategy.distributed:
        rep = _assemble(model, step_.timeline, step_.at_batch, step_, {**common, "notes": tuple(notes)})
        return rep if rep.cuda is None else dataclasses.replace(rep, notes=(*rep.notes, cuda.run_note(rep.cuda)))

    def at(poly: Poly) -> int:  # bytes at the report's batch and sequence length
        return poly(batch, step_.seq) if poly.has_s else poly(batch)

    ranks = per_rank(step_.timeline, model, strategy, spec.target, at)
    at_batch = per_rank(step_.at_batch, model, strategy, spec.target, at) if step_.separate else ranks
    per = tuple(
        RankReport(r.role, r.ranks, _assemble(model, r.timeline, a.timeline, step_, {**common, "notes": ()}))
        for r, a in zip(ranks, at_batch)
    )
    worst = max(per, key=lambda r: (r.report.peak_bytes if r.report.cuda is None else r.report.cuda.device))
    pieces = [p for r in per for p in r.report.pieces]
    keep = nondominated([p.bytes for p in pieces], step_.valid_from, step_.valid_to, step_.seq_range_lo)
    if worst.report.cuda is not None:
        notes.append(cuda.run_note(worst.report.cuda))
    return dataclasses.replace(worst.report, pieces=tuple(pieces[i] for i in keep), ranks=per, notes=tuple(notes))


def _with_sample_sizes(request: _Request, rep: Report) -> Report:
    """Under the default bound (``data_dependent='max'``), a report with sizes at their bound also
    gets the same step at the sample's sizes (``Report.at_sample``): the bound is what "will it
    fit" needs, the sample's what a run on it allocates.  The sample's sizes need a real forward
    (real weights) unless the sample's own values fix them; where they cannot be had, a note says
    why."""
    policy = request.spec.data_dependent
    bounded = {datadep.Source.BOUND, datadep.Source.BUDGET}
    if policy != datadep.Policy() or not any(site.source in bounded for site in rep.data_dependent):
        return rep
    sampled = dataclasses.replace(request, spec=dataclasses.replace(request.spec,
                                                                    data_dependent=datadep.Policy.of("sample")))
    try:
        at_sample = _result(sampled, _capture_step(sampled))
    except FxmemError as exc:
        why = f"the data-dependent sizes at the sample's values could not be had: {exc}"
        return dataclasses.replace(rep, notes=(*rep.notes, why))
    return dataclasses.replace(rep, at_sample=at_sample)


def _capture_formula(request: _Request) -> Formula:
    """The request's single-device step as formulas (``capture.path.formula``: symbolic, ``b`` alone, or
    concrete fits).  Requests with the same ``capture_key`` share it."""
    return capture_path.formula(request.model, request.sample, request.capture_spec, request.batch,
                                request.microbatches, request.seq_dims, request.seq)


def _capture_step(request: _Request, formula: Formula | None = None) -> Captured:
    """The captured step of ``request`` (``formula``: its capture, when shared) at the request's
    batch (``capture.path.at_batch``)."""
    formula = formula or _capture_formula(request)
    return capture_path.at_batch(request.model, request.sample, request.capture_spec, request.batch,
                                 request.microbatches, formula)


def _assemble(model: nn.Module, timeline: Timeline, at_batch: Timeline, step_: Captured, common: dict) -> Report:
    """The report of one device's step: the peak's pieces (formulas), the peak at the batch
    with its breakdown, module rows and, on CUDA, the allocator's view."""
    target, batch, seq = common["target"], common["batch"], common["seq"]
    # Bytes held outside the captured tensors at every op (CUDA: the cuBLAS workspaces).
    fixed = Poly.const(cuda.workspaces_held(timeline, target))
    candidates = timeline.candidates()
    keep = nondominated([poly for poly, _ in candidates], step_.valid_from, step_.valid_to, step_.seq_range_lo)
    pieces = tuple(Piece.at(timeline, *candidates[i][1], fixed) for i in keep)
    _, (peak_index, peak_k) = max(at_batch.candidates(), key=lambda c: c[0](batch))
    formulas = timeline if not step_.separate else at_batch  # in b (and s) where the formula holds
    live = formulas.ops[peak_index].live_at(peak_k) if formulas.ops else formulas.baseline
    breakdown = {c: v(batch, seq) if v.has_s else v(batch) for c, v in zip(CATEGORIES, live)}
    on_device = cuda.predict(at_batch, batch, target) if target.is_cuda else None
    return Report(
        **common,
        peak_bytes=sum(breakdown.values()) if on_device is None else on_device.allocated,
        pieces=pieces,
        breakdown=breakdown,
        breakdown_formula=dict(zip(CATEGORIES, live)),
        peak_piece=Piece.at(formulas, peak_index, peak_k, fixed),
        modules=_module_rows(model, at_batch, peak_index),
        timeline=timeline,
        cuda=on_device,
    )


def _generated(generation: step.Generation, timeline: Timeline, batch: int, prompt: int) -> Generated:
    decoding = timeline.decoding
    if decoding is None or not decoding.calls:
        raise CaptureError("mode='generate': generate() never called the model")
    _, (peak, _) = max(timeline.candidates(), key=lambda c: c[0](batch))
    call = max(bisect.bisect_right(decoding.calls, peak) - 1, 0)
    return Generated(generation.new_tokens, prompt, decoding.cache or "no cache", decoding.bytes_per_token,
                     decoding.tokens, call)


def _generated_note(generated: Generated, batch: int) -> str:
    cache = (f"its {generated.cache} holds {generated.kv_bytes_per_token:,} B per token and sequence "
             f"(keys and values of every layer): {generated.kv_bytes(batch):,} B for {generated.cache_tokens} tokens "
             f"x {batch} sequences after the last call" if generated.kv_bytes_per_token else
             "the model returned no KV cache (past_key_values): nothing is counted as one")
    needed = generated.prompt_tokens + generated.new_tokens - 1  # the last new token's keys are never computed
    if generated.cache == "StaticCache" and generated.cache_tokens > needed:
        cache += (f"; it is sized for {generated.cache_tokens} tokens, more than this call needs "
                  f"({needed}): transformers sizes a static cache for the longest generation the model object has "
                  "run (its _previous_max_cache_length), as a real call on this model would")
    return f"generate: the peak is in {generated.where}; {cache}"


def _kept_output_note(timeline: Timeline, batch: int) -> list[str]:
    """The cost of ``keep_output=True``: the forward's tensors alive to the end of the step (the
    model's output and the loss) at ``batch``, and whether they are part of the peak."""
    kept = [(nbytes, op) for nbytes, category, op, freed in timeline.storages
            if category is Category.ACTIVATION and freed is None and op >= 0
            and timeline.ops[op].phase is Phase.FORWARD]
    total = sum(nbytes(batch) for nbytes, _ in kept)
    if not total:
        return []
    _, (peak, _) = max(timeline.candidates(), key=lambda c: c[0](batch))
    at_peak = all(op <= peak for _, op in kept)
    where = ("part of the peak: a loop that drops the output before backward() (Hugging Face's Trainer, Lightning, "
             "torchtitan; keep_output=False) peaks up to that much lower" if at_peak else "not part of the peak")
    return [f"keep_output=True: the model's output and the loss stay alive through backward and the optimizer step "
            f"(out = model(x); loss = loss_fn(out, y); loss.backward(), as in PyTorch's tutorials and nanoGPT): "
            f"{total:,} B at b = {batch}, {where}"]


def _batch_note(strategy: Strategy) -> str:
    k = strategy.multiple
    if strategy.pipeline > 1:
        return (f"pipeline: {strategy.microbatches} micro-batches of b/{strategy.microbatches} per step; "
                f"b must be a multiple of {k}")
    return f"gradient accumulation: {k} micro-batches of b/{k} per optimizer step; b must be a multiple of {k}"


def _strategy(strategy: Strategy | None, mode: Mode, model: nn.Module, batch: int) -> Strategy:
    """``strategy`` checked against the mode, the model (checkpointed modules exist) and ``batch``."""
    if strategy is None:
        return DEFAULT
    if not isinstance(strategy, Strategy):
        raise InputError(f"strategy must be an estimator.vocab.strategy.Strategy, got {type(strategy).__name__}")
    if mode is not Mode.TRAIN and dataclasses.replace(strategy, amp=None, grad_scaler=None) != DEFAULT:
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


def _sample_batch(sample: Any, batch_dims: int | Mapping | None = None) -> int:
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


def _module_rows(model: nn.Module, timeline: Timeline, peak_index: int) -> tuple[ModuleRow, ...]:
    alive = {id(s) for s in timeline.alive_at(peak_index)} if peak_index >= 0 else set()
    activations: dict[str, Poly] = {}
    at_peak: dict[str, Poly] = {}
    for s in timeline.storages:
        nbytes, category, op_index, _ = s
        if op_index < 0:
            continue
        module = timeline.ops[op_index].module
        if category is Category.ACTIVATION:
            activations[module] = activations.get(module, ZERO) + nbytes
        if id(s) in alive:
            at_peak[module] = at_peak.get(module, ZERO) + nbytes

    def within(table: dict[str, Poly], path: str) -> Poly:
        total = ZERO
        for module, value in table.items():
            if not path or module == path or module.startswith(path + "."):
                total = total + value
        return total

    rows = []
    for path, module in model.named_modules():
        params = {id(p): p for p in module.parameters()}.values()
        rows.append(
            ModuleRow(
                path=path,
                type=type(module).__name__,
                params=sum(p.numel() for p in params),
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                activations=within(activations, path),
                at_peak=within(at_peak, path),
            )
        )
    return tuple(rows)


def _optimizer_name(optimizer) -> str | None:
    if optimizer is None or isinstance(optimizer, str):
        return optimizer
    return getattr(optimizer, "__name__", type(optimizer).__name__)
