"""``estimator.report()``: the public face of one estimate.

Its arguments become one ``Request`` (``estimator.vocab.request``), which
``estimator.orchestrate.estimate`` checks, captures, accounts and assembles into a ``Report``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from estimator.capture import steps
from estimator.orchestrate.estimate import estimate
from estimator.reporting.result import Report
from estimator.vocab.request import DEFAULT_OPTIMIZER, Request
from estimator.vocab.strategy import Strategy

__all__ = ["Request", "estimate", "report"]


def report(
    model: nn.Module,
    sample: Any,
    *,
    batch: int | None = None,
    mode: str = "train",
    optimizer: str | steps.OptimizerFactory | None = DEFAULT_OPTIMIZER,
    loss_fn: steps.LossFn | None = None,
    device: str = "cuda",
    gpu: str | int | None = None,
    alloc_conf: str | None = None,
    amp: str | None = None,
    grad_scaler: bool | None = None,
    dynamic: Mapping | None = None,
    strategy: Strategy | None = None,
    data_dependent: Any = "max",
    batch_dims: int | Mapping | None = None,
    step: steps.StepFn | None = None,
    keep_output: bool | None = None,
    new_tokens: int | None = None,
    cache_implementation: str | None = None,
    dtype_symbols: bool = False,
    compile: Any = None,
    depth_symbols: bool = False,
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
            a data-dependent *value* (``.item()``, ``if tensor:``) the real forward gives it; where
            that value follows an MoE router's picks (expert parallelism's token counts) and the
            weights are on the meta device, the picks are taken at their bound (every token to the
            same experts: the first rank's receive every rank's tokens), or spread evenly with
            ``"balanced"`` (``"max"`` for the sizes, and no real forward even with real weights).
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
        depth_symbols: also write the peak in terms of the number of blocks ``L`` of the model's
            repeated blocks (``Report.depth_formula``, in ``b`` and ``L``): the capture of a few
            blocks that builds the model's depth builds the step one unit deeper too, and each
            candidate peak is the line through the two, exact from six units of blocks on.  Only
            where the blocks were built from a few (``report.notes`` say so), not with
            ``mode="generate"`` nor with strategies over several devices.
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
        A frozen ``Report``: ``estimator.estimate(estimator.Request(model, sample, **options))``
        (``compare`` and ``plan`` build the same request, once per strategy).

    Example:
        >>> import torch, estimator
        >>> model = torch.nn.Linear(16, 4)
        >>> rep = estimator.report(model, torch.randn(8, 16), batch=32, optimizer="sgd")  # an H100
        >>> rep.peak_bytes == rep.at(32) and rep.peak_bytes <= rep.reserved_bytes <= rep.device_bytes
        True
        >>> estimator.report(model, torch.randn(8, 16), batch=32, optimizer="sgd", device="cpu").reserved_bytes is None
        True

    Known limitations: memory must be polynomial in ``b`` (models whose batch rows interact
    through data-dependent shapes cannot be captured); a sample tensor with gaps (a slice of a
    larger one) is taken as contiguous (dense ones keep their layout: channels-last, transposed).
    """
    return estimate(Request(
        model, sample, batch=batch, mode=mode, optimizer=optimizer, loss_fn=loss_fn, device=device, gpu=gpu,
        alloc_conf=alloc_conf, amp=amp, grad_scaler=grad_scaler, dynamic=dynamic, strategy=strategy,
        data_dependent=data_dependent, batch_dims=batch_dims, step=step, keep_output=keep_output,
        new_tokens=new_tokens, cache_implementation=cache_implementation, dtype_symbols=dtype_symbols,
        compile=compile, depth_symbols=depth_symbols))

