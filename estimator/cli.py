"""The ``fxmem`` command line (also ``python -m estimator``).

    fxmem report gpt --size gpt2-small --batch 8
    fxmem formula resnet --format latex
    fxmem fit llama --size 7b --budget 80GiB --json
    fxmem report mlp --step my_step.py:train_step

Exit codes: 0 success, 2 bad arguments or input, 3 the model could not be captured,
130 interrupted (Ctrl-C).

Torch is imported inside the commands only: ``fxmem --help`` stays fast.
"""

from __future__ import annotations

import functools
import gc
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass

import click

from estimator.capture import watchdog

EXIT_OK, EXIT_INPUT, EXIT_CAPTURE, EXIT_INTERRUPTED = 0, 2, 3, 130
MODES = ("train", "inference", "generate")
DEVICES = ("cpu", "cuda")
FORMATS = ("sympy", "latex", "markdown", "json")

MODEL_HELP = """MODEL is one of:

\b
  a zoo name        mlp, resnet, unet, vit, gpt, bert, rnn, lora, tied_autoencoder, llama
                    (--size picks the size; `fxmem models` lists them)
  FILE.py:FUNC      FUNC() returns (model, sample) or (model, sample, loss_fn)
  MODULE:FUNC       the same, from an importable module (package.module:make)
  SOURCE:NAME       transformers:gpt2, timm:resnet50, torchvision:resnet18
"""
STEP_HELP = """
\b
--step FILE.py:FUNC runs your own training step, FUNC(model, sample, state), instead of the
built-in one (forward, loss, backward, optimizer step); state is what --optimizer builds from
the model: a name (adamw: AdamW over model.parameters()) or FILE.py:FUNC, FUNC(model) -> state.
"""


@dataclass
class Options:
    """What every estimating command takes (after the checks that need no capture)."""

    model: str
    size: str | None
    batch: int | None
    mode: str
    optimizer: str | None
    dtype: str | None
    device: str
    gpu: str | None
    amp: str | None
    seq: tuple[str, ...]
    batch_dim: tuple[str, ...]
    alloc_conf: str | None
    data_dependent: tuple[str, ...]
    device_init: str
    quiet: bool
    accumulate: int
    checkpoint: str | None
    data_parallel: int
    zero: str | None
    pipeline: int
    microbatches: int | None
    schedule: str
    master_weights: bool
    step: str | None
    compile_mode: str | None
    keep_output: bool | None
    generate: int | None
    cache: str | None
    seq_len: int | None


def model_options(func=None, *, strategy: bool = True):
    """The options shared by ``report``, ``formula`` and ``fit`` (and, without the strategy
    options and ``--keep-output``, ``compare`` and ``plan``, where ``--step`` is hidden and refused)."""
    if func is None:
        return functools.partial(model_options, strategy=strategy)
    options = [
        click.argument("model", metavar="MODEL"),
        click.option("--size", "-s", metavar="SIZE", help="zoo model size (default: debug, a tiny test size)."),
        click.option(
            "--batch", "-b", type=click.IntRange(min=1), metavar="N",
            help="batch size to evaluate at (default: 8 for zoo models, else the sample's).",
        ),
        click.option("--mode", "-m", type=click.Choice(MODES, case_sensitive=False), default="train", show_default=True,
                     help="step to predict."),
        click.option(
            "--optimizer", "-o", metavar="NAME",
            help="sgd, sgd-momentum, adam, adamw, adagrad, rmsprop, … or 'none' (default: adamw; ignored, with "
                 "a note, in inference); or FILE.py:FUNC, a function of yours: FUNC(params) -> Optimizer"
                 + (", or with --step FUNC(model) -> the state your step is handed (an optimizer, a tuple or dict "
                    "of them, an EMA copy, a GradScaler)." if strategy else "."),
        ),
        click.option(
            "--step", metavar="FILE.py:FUNC", hidden=not strategy,  # compare / plan: refused, with the reason
            help="your own training step instead of the built-in one: FUNC(model, sample, state) runs forward, "
                 "loss, backward and the optimizer step as you wrote them (state: what --optimizer builds from the "
                 "model; inference: model.eval(), state None); also package.module:FUNC.  Not with --amp or "
                 "--keep-output/--drop-output (your step does that itself) nor strategies other than --checkpoint.",
        ),
        click.option("--dtype", type=click.Choice(("fp32", "bf16", "fp16"), case_sensitive=False),
                     help="parameter dtype (default: as built)."),
        click.option("--generate", type=click.IntRange(min=1), metavar="N", hidden=not strategy,
                     help="model.generate() of N new tokens per sequence (a transformers causal LM; --mode "
                          "generate): the prefill and N-1 decode steps, the KV cache its own category."),
        click.option("--cache", type=click.Choice(("dynamic", "static"), case_sensitive=False), hidden=not strategy,
                     help="--generate's KV cache: dynamic (transformers' default) or static (sized at the prefill)."),
        click.option("--seq-len", "seq_len", type=click.IntRange(min=1), metavar="S",
                     help="tokens per sample of a transformers model (the prompt with --generate; default "
                          "min(max positions, 512))."),
        click.option("--device", callback=_device, default="cuda", show_default=True, metavar="DEVICE",
                     help="target device: cuda (the GPU of --gpu; no GPU needed here) or cpu (an index such as "
                          "cuda:1 is accepted)."),
        click.option("--gpu", metavar="GPU", help="the GPU to predict for: H100, A100-40GB, RTX-4090, sm_90, 80GiB "
                     "(default: H100)."),
        click.option("--amp", type=click.Choice(("fp16", "bf16"), case_sensitive=False),
                     help="mixed precision: autocast (+ GradScaler for fp16)."),
        click.option(
            "--seq", multiple=True, metavar="KEY:DIM",
            help="make a sample dim the sequence length s (formulas in b and s): input_ids:1 for a dict "
                 "sample, 0:1 for a tuple, 1 for a single tensor; repeat for several tensors.",
        ),
        click.option(
            "--batch-dim", "batch_dim", multiple=True, metavar="[KEY:]DIM",
            help="the sample's batch dim when it is not 0: 1 for every tensor (a sequence-first (seq, batch, d) "
                 "sample of nn.LSTM / nn.Transformer with batch_first=False), input:1 for a dict sample's key, 0:1 "
                 "for a tuple's position; repeat for several tensors.",
        ),
        click.option(
            "--data-dependent", "data_dependent", multiple=True, metavar="POLICY",
            help="sizes fake tensors cannot know (x[mask], nonzero, MoE routing): max (default, the upper "
                 "bound), sample (observed on the sample; real weights, so --device-init cpu), a fraction "
                 "such as 0.5, or SITE=N for one call site (the report's notes name them); repeatable.",
        ),
        click.option("--alloc-conf", metavar="CONF", help="PYTORCH_CUDA_ALLOC_CONF to model (GPU target; "
                     "default: the environment's)."),
        click.option(
            "--device-init", type=click.Choice(("meta", "cpu")), default="meta", show_default=True,
            help="where zoo and integration models are built (meta allocates nothing).",
        ),
        click.option("--quiet", "-q", is_flag=True, help="no progress lines on stderr."),
        *(STRATEGY_OPTIONS + BUILTIN_STEP_OPTIONS if strategy else []),
    ]
    for option in reversed(options):
        func = option(func)
    return func


DTYPE_SYMBOLS_HELP = ("also the formula in the element width w of the model's float dtype (w = 4 fp32, 2 bf16/fp16; "
                      "parameters Ψ·w, Adam state 2Ψ·w): the step is captured at fp32, bf16 and fp16.")
STRATEGY_OPTIONS = [
    click.option("--accumulate", type=click.IntRange(min=1), default=1, metavar="K",
                 help="gradient accumulation over K micro-batches of b/K."),
    click.option("--checkpoint", metavar="MODULES",
                 help="activation checkpointing: a module type (Block), path (transformer.h.0) or glob (transformer.h.*)."),
    click.option("--data-parallel", "--dp", "data_parallel", type=click.IntRange(min=1), default=1, metavar="N",
                 help="data parallel over N devices (DDP; each runs b samples)."),
    click.option("--zero", type=click.Choice(("1", "2", "3")), help="ZeRO stage over the --dp devices "
                 "(1: ZeroRedundancyOptimizer, 2/3: FSDP2 fully_shard, reshard_after_forward False/True)."),
    click.option("--pipeline", type=click.IntRange(min=1), default=1, metavar="S", help="pipeline over S stages."),
    click.option("--microbatches", type=click.IntRange(min=1), metavar="M", help="pipeline micro-batches (default S)."),
    click.option("--schedule", type=click.Choice(("1f1b", "gpipe"), case_sensitive=False), default="1f1b",
                 show_default=True,
                 help="pipeline schedule."),
    click.option("--master-weights", is_flag=True,
                 help="fp32 master weights for low-precision parameters (with --dtype bf16 / fp16)."),
    click.option("--compile", "compile_mode", is_flag=False, flag_value="default", metavar="[MODE]",
                 type=click.Choice(("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")),
                 help="the model torch.compile'd (Inductor), optionally with a mode: the compiled program's "
                      "buffers, as its generated code allocates and frees them."),
]
BUILTIN_STEP_OPTIONS = [
    click.option("--keep-output/--drop-output", "keep_output", default=None,
                 help="the built-in step keeps the model's output alive through backward (--keep-output, the "
                      "default: out = model(x); loss = loss_fn(out, y), as the PyTorch tutorials and nanoGPT) or "
                      "drops it before backward (--drop-output, as HF Trainer, Lightning and torchtitan)."),
]


def _strategy(opts: Options, model):
    """The ``Strategy`` of the command-line options (``--checkpoint Block``: the module type of
    that name in ``model``)."""
    from estimator.vocab.strategy import Strategy

    return Strategy(
        accumulate=opts.accumulate, checkpoint=_module_type(opts.checkpoint, model), data_parallel=opts.data_parallel,
        sharding=None if opts.zero is None else f"zero{opts.zero}", pipeline=opts.pipeline,
        microbatches=opts.microbatches, schedule=opts.schedule, master_weights=opts.master_weights,
        compile=True if opts.compile_mode == "default" else opts.compile_mode or False,
    )


def _options(kwargs) -> Options:
    defaults = {"accumulate": 1, "checkpoint": None, "data_parallel": 1, "zero": None, "pipeline": 1,
                "microbatches": None, "schedule": "1f1b", "master_weights": False, "compile_mode": None, "keep_output": None,
                "generate": None, "cache": None}
    opts = Options(**{k: kwargs.pop(k, defaults.get(k)) for k in list(Options.__dataclass_fields__)})
    from estimator.vocab.errors import InputError

    for flag, value in (("--gpu", opts.gpu), ("--alloc-conf", opts.alloc_conf)):
        if value is not None and opts.device != "cuda":
            raise InputError(f"{flag} {value} describes the GPU target but --device {opts.device} asks for the CPU: "
                             f"drop --device {opts.device} (the GPU is the default) or {flag}")
    if opts.generate is not None or opts.cache is not None:
        if opts.generate is None:
            raise InputError("--cache is the KV cache of --generate N: add --generate")
        if opts.mode not in ("train", "generate"):  # train: --mode's default
            raise InputError(f"--generate runs model.generate(), not --mode {opts.mode}: drop --mode")
        training = [flag for flag, set_ in (
            ("--step", opts.step is not None), ("--amp", opts.amp is not None), ("--accumulate", opts.accumulate != 1),
            ("--checkpoint", opts.checkpoint is not None), ("--dp", opts.data_parallel != 1),
            ("--zero", opts.zero is not None), ("--pipeline", opts.pipeline != 1),
            ("--master-weights", opts.master_weights), ("--keep-output/--drop-output", opts.keep_output is not None),
            ("--compile", opts.compile_mode is not None))
            if set_]
        if training:
            raise InputError(f"--generate runs model.generate() as it is: drop {', '.join(training)} (--dtype bf16 "
                             "for a low-precision generation)")
        opts.mode = "generate"
    elif opts.mode == "generate":
        raise InputError("--mode generate needs --generate N, the tokens to generate per sequence")
    return opts


def _status(opts: Options, message: str) -> None:
    if not opts.quiet:
        click.echo(f"fxmem: {message}", err=True)


def _estimate(opts: Options, run=None, **extra):
    """Build the model and capture it: ``run(model, sample, **report options)`` (default
    ``estimator.report``, with the strategy options), with progress lines on stderr."""
    start = time.perf_counter()
    _quiet_torch_import()
    import estimator
    from estimator import models

    # the user's functions first: a typo in them fails before the model is built
    user_step = _user_function(opts.step, "--step", "a function step(model, sample, state)")
    optimizer = _optimizer(opts.optimizer, user_step is not None)
    built = models.resolve(opts.model, size=opts.size, batch=opts.batch, dtype=opts.dtype, device_init=opts.device_init,
                           seq_len=opts.seq_len)
    batch = opts.batch or built.batch
    _status(opts, f"capturing {built.label}, {opts.mode}" + (f", step {opts.step}" if opts.step else "")
            + (f", b={batch}" if batch else "") + " ...")
    if run is None:
        run, extra = estimator.report, {"amp": opts.amp, "strategy": _strategy(opts, built.model),
                                        "keep_output": opts.keep_output, "step": user_step, **extra}
    sample = built.sample
    if opts.generate is not None:  # generate() as it is: no strategy, no loss; the sample is a prompt
        from estimator.vocab.errors import InputError
        from estimator.capture.steps import Generation

        if not isinstance(sample, dict) or "input_ids" not in sample:
            raise InputError(f"--generate needs a text model whose sample has input_ids; {built.label} has none")
        sample = Generation.prompt(sample)
        extra = {k: v for k, v in extra.items() if k not in ("amp", "strategy", "keep_output", "step")}  # refused
        extra |= {"new_tokens": opts.generate, "cache_implementation": opts.cache}
    result = run(
        built.model,
        sample,
        batch=opts.batch,
        mode=opts.mode,
        optimizer=optimizer,
        loss_fn=None if user_step is not None or opts.generate else built.loss_fn,  # yours / generate(): no loss
        device=opts.device,
        gpu=opts.gpu,
        alloc_conf=opts.alloc_conf,
        dynamic=_dynamic(opts.seq),
        data_dependent=_data_dependent(opts.data_dependent),
        batch_dims=_batch_dims(opts.batch_dim),
        **extra,
    )
    if _INTERRUPTED.is_set():  # a Ctrl-C that landed in a weakref callback was only printed, not raised
        raise KeyboardInterrupt
    _status(opts, f"done in {time.perf_counter() - start:.1f} s")
    return result


def _user_function(text: str | None, flag: str, what: str):
    """``--step FILE.py:FUNC`` (or ``package.module:FUNC``): the function, loaded as a MODEL
    factory is; its errors name the flag."""
    if text is None:
        return None
    from estimator import models
    from estimator.vocab.errors import InputError

    try:
        return models.load_function(text, what)
    except InputError as exc:
        raise InputError(f"{flag}: {exc}") from None


def _optimizer(text: str | None, user_step: bool):
    """``--optimizer``: a name (default adamw), ``none``, or ``FILE.py:FUNC``, a function of the
    user's (``params -> Optimizer``; with ``--step``, ``model -> state``)."""
    if text is None:
        return "adamw"
    if text.strip().lower() == "none":
        return None
    if ":" not in text:
        return text
    what = "a function make_state(model) -> state" if user_step else "a function make(params) -> Optimizer"
    return _user_function(text, "--optimizer", what)


def _trainer_run(path: str, opts: Options):
    """``report --training-args FILE.json``: ``run`` for ``_estimate`` that estimates Trainer's step
    (``integrations.transformers.from_training_args``); the options the arguments decide are refused,
    ``--dp N`` is the run's world size."""
    from estimator.vocab.errors import InputError

    given = [flag for flag, set_ in (("--step", opts.step is not None), ("--optimizer", opts.optimizer is not None),
                                     ("--amp", opts.amp is not None), ("--accumulate", opts.accumulate != 1),
                                     ("--checkpoint", opts.checkpoint is not None), ("--zero", opts.zero is not None),
                                     ("--pipeline", opts.pipeline != 1), ("--master-weights", opts.master_weights),
                                     ("--keep-output/--drop-output", opts.keep_output is not None),
                                     ("--mode", opts.mode != "train"))
             if set_]
    if given:
        raise InputError(f"--training-args decides {', '.join(given)} (Trainer's step, optimizer, precision, "
                         f"accumulation, checkpointing): drop {' and '.join(given)}")

    def run(model, sample, *, batch, mode, optimizer, loss_fn, **kwargs):
        from estimator.integrations.transformers import from_training_args

        return from_training_args(model, path, sample, world_size=opts.data_parallel, batch=batch, **kwargs)

    return run


def _no_step(opts: Options, command: str) -> None:
    """``compare`` / ``plan`` weigh strategies that transform the built-in step: not with ``--step``."""
    if opts.step is not None:
        from estimator.vocab.errors import InputError

        raise InputError(f"--step: fxmem {command} weighs strategies that transform the built-in step (accumulation, "
                         "AMP, DDP, ZeRO, pipeline), which cannot combine with your own step; estimate your step with "
                         "fxmem report MODEL --step FILE.py:FUNC (--checkpoint MODULES applies to it)")


def _data_dependent(specs: tuple[str, ...]):
    """``--data-dependent sample --data-dependent 'moe:nonzero#0=100'`` -> ``report(data_dependent=)``."""
    policy: dict = {}
    for spec in specs:
        site, eq, value = spec.rpartition("=")
        key = site if eq else "*"
        try:
            policy[key] = int(value) if eq and value.isdigit() else float(value)
        except ValueError:
            policy[key] = value
    return policy or None


def _dynamic(specs: tuple[str, ...]) -> dict | None:
    """``--seq input_ids:1 --seq labels:1`` -> ``report(dynamic=)``; ``--seq 1`` for a tensor sample."""
    from estimator.vocab.errors import InputError

    if not specs:
        return None
    dynamic: dict = {}
    for spec in specs:
        key, _, dim = spec.rpartition(":")
        if not dim.isdigit():
            raise InputError(f"--seq {spec!r}: expected KEY:DIM (input_ids:1), POSITION:DIM (0:1) or DIM (1)")
        if not key:
            dynamic[int(dim)] = "s"
            continue
        dynamic.setdefault(int(key) if key.isdigit() else key, {})[int(dim)] = "s"
    single = {k for k, v in dynamic.items() if v == "s"}
    if single and len(single) != len(dynamic):
        raise InputError("--seq: give either DIM alone (a single-tensor sample) or KEY:DIM forms, not both")
    return dynamic


def _batch_dims(specs: tuple[str, ...]):
    """``--batch-dim 1`` -> ``report(batch_dims=1)``; ``--batch-dim src:1 --batch-dim 1:0`` ->
    ``{"src": 1, 1: 0}`` (a dict key, or a tuple position)."""
    from estimator.vocab.errors import InputError

    if not specs:
        return None
    dims: dict = {}
    for spec in specs:
        key, _, dim = spec.rpartition(":")
        if not dim.lstrip("-").isdigit():
            raise InputError(f"--batch-dim {spec!r}: expected DIM (1), KEY:DIM (input:1) or POSITION:DIM (0:1)")
        if not key:
            if len(specs) > 1:
                raise InputError("--batch-dim: give either DIM alone (every tensor) or KEY:DIM forms, not both")
            return int(dim)
        dims[int(key) if key.isdigit() else key] = int(dim)
    return dims


def _device(ctx, param, value: str) -> str:
    """``--device``: cpu or cuda, any case, an index allowed (``cuda:1``)."""
    name, _, index = value.strip().lower().partition(":")
    if name not in DEVICES or (index and not index.isdigit()):
        raise click.BadParameter(f"{value!r}: expected one of {', '.join(DEVICES)} (an index such as cuda:1 is "
                                 "accepted)")
    return name


def _quiet_torch_import() -> None:
    """Torch warns on import when NumPy is missing, which the estimator does not need."""
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)


def _budget(text: str | None) -> int | None:
    """Bytes of ``--budget``, parsed before any capture (a typo fails in no time)."""
    if text is None:
        return None
    from estimator.vocab.units import parse_bytes

    return parse_bytes(text)


def handle_errors(func):
    """InputError/CaptureError → one line on stderr and exit 2/3; Ctrl-C → exit 130."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        from estimator.vocab.errors import CaptureError, InputError

        try:
            return func(*args, **kwargs)
        except InputError as exc:
            _fail(f"error: {exc}", EXIT_INPUT)
        except CaptureError as exc:
            _fail(f"error: cannot capture the model: {exc}", EXIT_CAPTURE)

    return wrapper


def _fail(message: str, code: int) -> None:
    click.echo(f"fxmem: {message}", err=True)
    raise click.exceptions.Exit(code)


class Group(click.Group):
    def list_commands(self, ctx):
        return list(self.commands)  # in definition order, not sorted


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="fxmem", prog_name="fxmem", message="%(prog)s %(version)s")
def cli():
    """Static memory estimates of PyTorch training and inference steps, as formulas in the batch size.

    Nothing runs on real data: the step runs once on fake tensors with a symbolic batch size b,
    so the peak is an exact formula in b.  The target is a GPU (--gpu, default an H100: no GPU
    is needed to predict for one) or the CPU (--device cpu).

    \b
    Examples:
      fxmem report gpt --size gpt2-small --batch 8
      fxmem report resnet --size resnet50 --batch 32 --mode inference --json
      fxmem formula gpt --format latex
      fxmem fit llama --size 7b --budget 80GiB --dtype bf16
      fxmem report my_model.py:make --batch 16
      fxmem report my_model.py:make --step my_step.py:train_step
      fxmem models

    Exit codes: 0 ok, 2 bad input or usage, 3 the model could not be captured, 130 interrupted.
    """


@cli.command(epilog=MODEL_HELP + STEP_HELP, short_help="peak memory of one step: the table (or --json).")
@model_options
@click.option("--budget", metavar="BYTES", help="also print the largest batch that fits, e.g. 80GiB, 40GB.")
@click.option("--json", "as_json", is_flag=True, help="print JSON (to_json: exact integer coefficients).")
@click.option("--dtype-symbols", is_flag=True, help=DTYPE_SYMBOLS_HELP)
@click.option("--training-args", "training_args", metavar="FILE.json",
              help="estimate the optimizer step of transformers.Trainer with these TrainingArguments (a JSON object "
                   "of its fields): b is per_device_train_batch_size x gradient_accumulation_steps; its precision, "
                   "checkpointing, optimizer and accumulation replace --amp, --checkpoint, --optimizer, --accumulate "
                   "(--dp N: the run's world size).")
@handle_errors
def report(budget, as_json, dtype_symbols, training_args, **kwargs):
    """Peak memory of one step of MODEL: the table, by category and by module.

    \b
    Examples:
      fxmem report gpt --size gpt2-small --batch 8
      fxmem report resnet --size resnet50 --batch 64 --mode inference
      fxmem report llama --size 7b --batch 1 --dtype bf16 --budget 80GiB
      fxmem report gpt --batch 8 --gpu A100-80GB
      fxmem report gpt --batch 8 --device cpu
      fxmem report gpt --batch 8 --amp bf16 --seq input_ids:1
      fxmem report path/to/model.py:make --json | jq .peak_bytes
      fxmem report mlp --step my_step.py:train_step --optimizer my_step.py:make_state
      fxmem report gpt --batch 8 --drop-output
      fxmem report transformers:gpt2 --generate 128 --seq-len 512 --batch 16
      fxmem report transformers:gpt2 --training-args args.json --device cpu
    """
    opts = _options(kwargs)
    limit = _budget(budget)
    run = _trainer_run(training_args, opts) if training_args is not None else None
    rep = _estimate(opts, run, dtype_symbols=dtype_symbols)
    fit = rep.max_batch(limit) if limit is not None else None
    if as_json:
        data = json.loads(rep.to_json())
        if limit is not None:
            data["budget"] = {"bytes": limit, "max_batch": fit}
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(str(rep))
        if rep.dtype_formula is not None:
            from estimator.reporting.formulas import dtype_markdown

            click.echo("\n" + "\n".join(dtype_markdown(rep.dtype_formula)))
        if limit is not None:
            memory = " of device memory" if rep.cuda is not None else ""
            click.echo(f"\nlargest batch that fits in {budget}{memory}: {fit}{_range_note(rep, fit)}")


@cli.command(epilog=MODEL_HELP + STEP_HELP, short_help="the peak as a formula in b: sympy, latex, markdown, json.")
@model_options
@click.option("--format", "-f", "fmt", type=click.Choice(FORMATS), default="sympy", show_default=True,
              help="sympy: the peak expression; latex: an align* block; markdown: a table; json: coefficients.")
@click.option("--json", "as_json", is_flag=True, help="the same as --format json.")
@click.option("--dtype-symbols", is_flag=True, help=DTYPE_SYMBOLS_HELP)
@handle_errors
def formula(fmt, as_json, dtype_symbols, **kwargs):
    """The peak memory of MODEL as a formula in the batch size b (bytes).

    \b
    Examples:
      fxmem formula gpt --size gpt2-small
      fxmem formula resnet --format latex > peak.tex
      fxmem formula vit --format markdown --mode inference
      fxmem formula mlp --format json
      fxmem formula mlp --step my_step.py:train_step
    """
    opts = _options(kwargs)
    rep = _estimate(opts, dtype_symbols=dtype_symbols)
    fmt = "json" if as_json else fmt
    from estimator.reporting.formulas import widths_text

    sympy_text = str(rep.peak) if rep.dtype_formula is None else "\n".join(
        [str(rep.peak), *(f"{line.peak}    # {widths_text(line.widths)}" for line in rep.dtype_formula.lines)])
    render = {"sympy": lambda: sympy_text, "latex": rep.to_latex, "markdown": rep.to_markdown, "json": rep.to_json}
    click.echo(render[fmt]().rstrip("\n"))


@cli.command(epilog=MODEL_HELP + STEP_HELP, short_help="the largest batch that fits in the GPU (or --budget).")
@model_options
@click.option("--budget", metavar="BYTES", help="the memory to fit in, e.g. 80GiB, 40GB, 512MiB (default: the GPU's "
              "memory, --gpu; --device cpu needs one).")
@click.option("--json", "as_json", is_flag=True, help="print JSON.")
@handle_errors
def fit(budget, as_json, **kwargs):
    """The largest batch size whose step of MODEL fits in the GPU's memory or --budget (exact).

    On the GPU (the default target: --gpu, else an H100) the budget is the device's memory, by
    default the GPU's, and what must fit is the predicted device memory (nvidia-smi: reserved by
    the caching allocator + the CUDA context).  --device cpu: the CPU's peak, against --budget.
    --batch only sets the batch size the model is captured at.

    \b
    Examples:
      fxmem fit gpt --size gpt2-small                      # the default GPU's memory
      fxmem fit gpt --size gpt2-small --gpu A100-40GB
      fxmem fit llama --size 7b --dtype bf16 --budget 80GiB --json
      fxmem fit resnet --size resnet50 --mode inference --budget 16GB --device cpu
      fxmem fit gpt --size gpt2-small --seq input_ids:1 --budget 24GiB   # also the longest s
    """
    opts = _options(kwargs)
    limit = _budget(budget)
    from estimator.vocab.errors import InputError

    if limit is None and opts.device != "cuda":
        raise InputError("fxmem fit --device cpu needs --budget (e.g. 64GiB); on the GPU (the default target) the "
                         "budget defaults to the GPU's memory")
    rep = _estimate(opts)
    from estimator.vocab.units import format_bytes

    gpu, given = rep.target.gpu, limit is not None
    if not given:
        if gpu.total_memory is None:
            raise InputError(f"--gpu {opts.gpu} names an architecture, not a memory size: give --budget")
        limit = gpu.total_memory
        default = " (the default GPU's: --gpu for yours)" if rep.target.default_gpu else ""
        budget = f"{format_bytes(limit)}, the {gpu.name}'s memory{default}"
    best = rep.max_batch(limit)
    peak = rep.at(best) if best else None
    on_device = rep.on_device(best) if best and rep.cuda is not None else None
    max_seq = rep.max_seq(limit) if rep.seq is not None else None  # at the report's batch
    if as_json:
        click.echo(json.dumps({
            "model": rep.model, "mode": rep.mode.value, "device": rep.device, "optimizer": rep.optimizer,
            "gpu": None if gpu is None else gpu.name, "budget_bytes": limit, "budget_given": given,
            "max_batch": best, "peak_bytes": peak,
            "reserved_bytes": None if on_device is None else on_device.reserved,
            "device_bytes": None if on_device is None else on_device.device, "peak": str(rep.peak),
            "valid_from": rep.valid_from, "valid_to": rep.valid_to, "seq": rep.seq,
            "max_seq": None if max_seq is None else {"batch": rep.batch, "max_seq": max_seq},
            "notes": list(rep.notes),
        }, indent=2))
    elif best:
        at_seq = f" at s = {rep.seq}" if rep.seq is not None else ""
        used = (f"peak {format_bytes(peak)} = {peak:,} B" if on_device is None else
                f"device memory {format_bytes(on_device.device)} = {on_device.device:,} B: {format_bytes(peak)} "
                f"allocated, {format_bytes(on_device.reserved)} reserved + the CUDA context")
        click.echo(f"largest batch that fits in {budget}{at_seq}: {best} ({used}){_range_note(rep, best)}")
    else:
        smallest = rep.at(rep.valid_from) if rep.cuda is None else rep.on_device(rep.valid_from).device
        what = "the peak" if rep.cuda is None else "the device memory"
        click.echo(f"nothing fits in {budget}: {what} at b = {rep.valid_from} is already "
                   f"{format_bytes(smallest)} ({smallest:,} B)")
    if max_seq is not None and not as_json:
        click.echo(f"longest sequence that fits in {budget} at b = {rep.batch}: {max_seq}")


def _range_note(rep, best: int | None) -> str:
    if best and rep.valid_to is not None and best >= rep.valid_to:
        return f" (capped: the formula holds up to b = {rep.valid_to} only; see the guards in `fxmem report`)"
    return ""


@cli.command(epilog=MODEL_HELP, short_help="strategies side by side: peak per device, savings, costs.")
@model_options(strategy=False)
@click.option("--devices", "-n", type=click.IntRange(min=1), default=4, show_default=True,
              help="devices for the distributed strategies.")
@click.option("--strategy", "specs", multiple=True, metavar="SPEC",
              help="a strategy instead of the default nine: Strategy fields as key=value, comma-separated "
                   "(data_parallel=4,sharding=zero3,amp=bf16,checkpoint=Block); repeat for several.")
@click.option("--budget", metavar="BYTES", help="also the largest batch that fits per device, e.g. 80GiB.")
@click.option("--json", "as_json", is_flag=True, help="print JSON.")
@handle_errors
def compare(devices, specs, budget, as_json, **kwargs):
    """Compare training strategies for MODEL: the peak per device of each at the same b (per
    device for data parallelism), against one device.

    Default: one device, bf16 autocast, checkpointing every block, DDP, ZeRO-1/2/3 and a 1F1B
    pipeline on --devices devices.

    \b
    Examples:
      fxmem compare gpt --size gpt2-small --batch 8
      fxmem compare gpt --batch 8 --devices 8 --budget 80GiB
      fxmem compare mlp --strategy data_parallel=2 --strategy data_parallel=2,sharding=zero3
    """
    opts = _options(kwargs)
    _no_step(opts, "compare")
    limit = _budget(budget)
    import estimator

    def run(model, sample, **options):
        strategies = [_parse_strategy(spec, model) for spec in specs] or None
        return estimator.compare(model, sample, strategies=strategies, devices=devices, budget=limit, **options)

    result = _estimate(opts, run)
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else str(result))


@cli.command(epilog=MODEL_HELP, short_help="the strategies that fit a budget per device, best first.")
@model_options(strategy=False)
@click.option("--devices", "-n", type=click.IntRange(min=1), default=1, show_default=True, help="devices available.")
@click.option("--budget", metavar="BYTES", help="memory per device, e.g. 80GiB (default: the GPU's; --device cpu needs "
              "one).")
@click.option("--json", "as_json", is_flag=True, help="print JSON.")
@handle_errors
def plan(devices, budget, as_json, **kwargs):
    """The strategies whose step of MODEL fits --budget on each of --devices devices, ranked by
    the most samples per optimizer step they allow.

    \b
    Examples:
      fxmem plan gpt --size gpt2-medium --budget 24GiB --devices 4
      fxmem plan llama --size 7b --gpu A100-80GB --devices 8
    """
    opts = _options(kwargs)
    _no_step(opts, "plan")
    limit = _budget(budget)
    import estimator

    def run(model, sample, **options):
        return estimator.plan(model, sample, limit, devices, **options)

    result = _estimate(opts, run)
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else str(result))


def _module_type(checkpoint, model):
    """``--checkpoint Block``: the module type of that name in ``model``; a path or glob (or
    anything that names no type) unchanged."""
    if not isinstance(checkpoint, str):
        return checkpoint
    types = {type(m).__name__: type(m) for m in model.modules()}
    return types.get(checkpoint, checkpoint)


def _parse_strategy(spec: str, model):
    """``data_parallel=4,sharding=zero3,checkpoint=Block`` -> ``Strategy``."""
    import dataclasses

    from estimator.vocab.errors import InputError
    from estimator.vocab.strategy import Strategy

    fields = {f.name for f in dataclasses.fields(Strategy)}
    kwargs = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise InputError(f"--strategy {spec!r}: expected key=value with keys among {sorted(fields)}, got {item!r}")
        kwargs[key] = _value(value.strip())
    if "checkpoint" in kwargs:
        kwargs["checkpoint"] = _module_type(kwargs["checkpoint"], model)
    if isinstance(kwargs.get("split_points"), str):
        kwargs["split_points"] = tuple(kwargs["split_points"].split("+"))
    return Strategy(**kwargs)


def _value(text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


@cli.command(short_help="the zoo models and their sizes.")
@click.option("--json", "as_json", is_flag=True, help="print JSON.")
def models(as_json):
    """The zoo models and their sizes (built from code, no downloads).

    \b
    Examples:
      fxmem models
      fxmem models --json
    """
    _quiet_torch_import()
    import models_zoo

    table = {name: models_zoo.sizes(name) for name in models_zoo.names()}
    if as_json:
        click.echo(json.dumps(table, indent=2))
    else:
        width = max(map(len, table))
        for name, sizes in table.items():
            click.echo(f"{name:<{width}}  {', '.join(sizes)}")


# Set by Ctrl-C.  Python cannot raise an exception out of a weakref callback (the capture's
# free events) or a __del__: a KeyboardInterrupt raised there is printed and dropped, and the
# capture would go on to print its table.  _estimate checks the flag when the capture returns.
_INTERRUPTED = threading.Event()


def _on_sigint(signum, frame):
    _INTERRUPTED.set()
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """The console-script entry: returns the exit code."""
    _INTERRUPTED.clear()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _on_sigint) if main_thread else None
    try:
        result = cli.main(args=argv, prog_name="fxmem", standalone_mode=False)
    except click.exceptions.Exit as exc:  # raised inside commands (standalone_mode=False passes it)
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("fxmem: interrupted", err=True)
        return EXIT_INTERRUPTED
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return result if isinstance(result, int) else EXIT_OK


_CAPTURING = ("report", "formula", "fit", "compare", "plan")  # the commands that capture a step


def entry() -> None:
    """The ``fxmem`` program (console script and ``python -m estimator``): ``main``, then exit.

    The objects that importing torch makes (millions, alive until the end) are kept out of the
    garbage collector's passes: for the commands that capture, imported with the collector
    paused, then frozen (``gc.freeze``); everything is frozen again before exiting, where the
    interpreter's last collection would walk them only for the process to end: about 1.3 s of
    ``fxmem report mlp --batch 8`` (3.7-4.0 s before, 2.3-2.6 s after, with the zoo's models
    imported on first use; docs/benchmark.md).  The capture itself runs with the collector as it
    is (its thresholds decide when cyclic garbage is freed)."""
    if sys.argv[1:2] and sys.argv[1] in _CAPTURING and not {"-h", "--help"} & set(sys.argv[2:]):
        watchdog.guard_process(EXIT_CAPTURE)  # a capture stuck in C++ ends with exit 3, not never
        gc.disable()
        try:
            _import_capture_stack()
        except KeyboardInterrupt:  # Ctrl-C while torch imports
            sys.exit(EXIT_INTERRUPTED)
        finally:
            gc.freeze()
            gc.enable()
    code = main()
    gc.freeze()
    sys.exit(code)


def _import_capture_stack() -> None:
    """The modules every capture imports: the estimator, torch, Dynamo (``FakeTensorMode``
    imports ``torch._dynamo.config``) and ``torch.export._trace`` (a ``ShapeEnv`` imports it to
    name the files its symbols' source locations skip, ``symbolic_shapes.uninteresting_files``)."""
    import torch._dynamo  # noqa: F401
    import torch.export._trace  # noqa: F401

    import estimator.api  # noqa: F401


if __name__ == "__main__":
    entry()
