"""The ``fxmem`` commands: the click group and ``report``, ``formula``, ``fit``, ``compare``,
``plan`` and ``models``.

Each estimating command parses its options (``estimator.cli.options``), builds MODEL
(``estimator.cli.models``) and captures it through the public API in ``_estimate``, with
progress lines on stderr; ``report --training-args`` estimates Trainer's step through
``estimator.integrations.training_args``.  ``handle_errors`` turns an ``InputError`` into exit 2
and a ``CaptureError`` into exit 3, one line on stderr each.

Torch is imported inside the commands only: ``fxmem --help`` stays fast.
"""

from __future__ import annotations

import functools
import json
import threading
import time

import click

from estimator.cli.options import (
    DEPTH_SYMBOLS_HELP,
    DTYPE_SYMBOLS_HELP,
    MODEL_HELP,
    STEP_HELP,
    Options,
    batch_dims,
    data_dependent,
    dynamic,
    model_options,
    optimizer,
    options,
    parse_budget,
    parse_strategy,
    strategy,
    user_function,
)

EXIT_OK, EXIT_INPUT, EXIT_CAPTURE, EXIT_INTERRUPTED = 0, 2, 3, 130
FORMATS = ("sympy", "latex", "markdown", "json")

# Set by Ctrl-C (``estimator.cli.main``'s SIGINT handler).  Python cannot raise an exception out
# of a weakref callback (the capture's free events) or a __del__: a KeyboardInterrupt raised
# there is printed and dropped, and the capture would go on to print its table.  _estimate
# checks the flag when the capture returns.
INTERRUPTED = threading.Event()


def _status(opts: Options, message: str) -> None:
    if not opts.quiet:
        click.echo(f"fxmem: {message}", err=True)


def _estimate(opts: Options, run=None, **extra):
    """Build the model and capture it: ``run(model, sample, **report options)`` (default
    ``estimator.report``, with the strategy options), with progress lines on stderr."""
    start = time.perf_counter()
    _quiet_torch_import()
    import estimator
    from estimator.cli import models

    # the user's functions first: a typo in them fails before the model is built
    user_step = user_function(opts.step, "--step", "a function step(model, sample, state)")
    optim = optimizer(opts.optimizer, user_step is not None)
    built = models.resolve(opts.model, size=opts.size, batch=opts.batch, dtype=opts.dtype, device_init=opts.device_init,
                           seq_len=opts.seq_len, quantize=opts.quantize, lora=opts.lora)
    batch = opts.batch or built.batch
    _status(opts, f"capturing {built.label}, {opts.mode}" + (f", step {opts.step}" if opts.step else "")
            + (f", b={batch}" if batch else "") + " ...")
    if run is None:
        run, extra = estimator.report, {"amp": opts.amp, "strategy": strategy(opts, built.model),
                                        "keep_output": opts.keep_output, "step": user_step, **extra}
    sample = built.sample
    if opts.generate is not None:  # generate() as it is: no strategy, no loss; the sample is a prompt
        from estimator.capture.steps import Generation
        from estimator.vocab.errors import InputError

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
        optimizer=optim,
        loss_fn=None if user_step is not None or opts.generate else built.loss_fn,  # yours / generate(): no loss
        device=opts.device,
        gpu=opts.gpu,
        alloc_conf=opts.alloc_conf,
        dynamic=dynamic(opts.seq),
        data_dependent=data_dependent(opts.data_dependent),
        batch_dims=batch_dims(opts.batch_dim),
        **extra,
    )
    if INTERRUPTED.is_set():  # a Ctrl-C that landed in a weakref callback was only printed, not raised
        raise KeyboardInterrupt
    _status(opts, f"done in {time.perf_counter() - start:.1f} s")
    return result


def _trainer_run(path: str, opts: Options):
    """``report --training-args FILE.json``: ``run`` for ``_estimate`` that estimates Trainer's step
    (``integrations.training_args.from_training_args``); the options the arguments decide are refused,
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
        from estimator.integrations.training_args import from_training_args

        return from_training_args(model, path, sample, world_size=opts.data_parallel, batch=batch, **kwargs)

    return run


def _no_step(opts: Options, command: str) -> None:
    """``compare`` / ``plan`` weigh strategies that transform the built-in step: not with ``--step``."""
    if opts.step is not None:
        from estimator.vocab.errors import InputError

        raise InputError(f"--step: fxmem {command} weighs strategies that transform the built-in step (accumulation, "
                         "AMP, DDP, ZeRO, pipeline), which cannot combine with your own step; estimate your step with "
                         "fxmem report MODEL --step FILE.py:FUNC (--checkpoint MODULES applies to it)")


def _quiet_torch_import() -> None:
    """Torch warns on import when NumPy is missing, which the estimator does not need."""
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)


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
@click.option("--depth-symbols", is_flag=True, help=DEPTH_SYMBOLS_HELP)
@click.option("--training-args", "training_args", metavar="FILE.json",
              help="estimate the optimizer step of transformers.Trainer with these TrainingArguments (a JSON object "
                   "of its fields): b is per_device_train_batch_size x gradient_accumulation_steps; its precision, "
                   "checkpointing, optimizer and accumulation replace --amp, --checkpoint, --optimizer, --accumulate "
                   "(--dp N: the run's world size).")
@handle_errors
def report(budget, as_json, dtype_symbols, depth_symbols, training_args, **kwargs):
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
    opts = options(kwargs)
    limit = parse_budget(budget)
    run = _trainer_run(training_args, opts) if training_args is not None else None
    rep = _estimate(opts, run, dtype_symbols=dtype_symbols, depth_symbols=depth_symbols)
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
        if rep.depth_formula is not None:
            from estimator.reporting.formulas import depth_markdown

            click.echo("\n" + "\n".join(depth_markdown(rep.depth_formula, rep.batch, rep.seq)))
        if limit is not None:
            memory = " of device memory" if rep.cuda is not None else ""
            click.echo(f"\nlargest batch that fits in {budget}{memory}: {fit}{_range_note(rep, fit)}")


@cli.command(epilog=MODEL_HELP + STEP_HELP, short_help="the peak as a formula in b: sympy, latex, markdown, json.")
@model_options
@click.option("--format", "-f", "fmt", type=click.Choice(FORMATS), default="sympy", show_default=True,
              help="sympy: the peak expression; latex: an align* block; markdown: a table; json: coefficients.")
@click.option("--json", "as_json", is_flag=True, help="the same as --format json.")
@click.option("--dtype-symbols", is_flag=True, help=DTYPE_SYMBOLS_HELP)
@click.option("--depth-symbols", is_flag=True, help=DEPTH_SYMBOLS_HELP)
@handle_errors
def formula(fmt, as_json, dtype_symbols, depth_symbols, **kwargs):
    """The peak memory of MODEL as a formula in the batch size b (bytes).

    \b
    Examples:
      fxmem formula gpt --size gpt2-small
      fxmem formula resnet --format latex > peak.tex
      fxmem formula vit --format markdown --mode inference
      fxmem formula mlp --format json
      fxmem formula mlp --step my_step.py:train_step
      fxmem formula llama --size 7b --depth-symbols    # also in L, the number of blocks
    """
    opts = options(kwargs)
    rep = _estimate(opts, dtype_symbols=dtype_symbols, depth_symbols=depth_symbols)
    fmt = "json" if as_json else fmt
    from estimator.reporting.formulas import widths_text

    sympy_text = "\n".join([str(rep.peak), *(f"{line.peak}    # {widths_text(line.widths)}"
                                             for line in (rep.dtype_formula.lines if rep.dtype_formula else ())),
                            *([f"{rep.depth_formula.peak}    # L = blocks of {rep.depth_formula.path}"]
                              if rep.depth_formula else [])])
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
    opts = options(kwargs)
    limit = parse_budget(budget)
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
@click.option("--workers", type=click.IntRange(min=1), default=None, metavar="N",
              help="processes that capture the distinct steps (default: one per core; 1: in this one).")
@click.option("--json", "as_json", is_flag=True, help="print JSON.")
@handle_errors
def compare(devices, specs, budget, workers, as_json, **kwargs):
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
    opts = options(kwargs)
    _no_step(opts, "compare")
    limit = parse_budget(budget)
    import estimator

    def run(model, sample, **options):
        strategies = [parse_strategy(spec, model) for spec in specs] or None
        return estimator.compare(model, sample, strategies=strategies, devices=devices, budget=limit,
                                 workers=workers, **options)

    result = _estimate(opts, run)
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else str(result))


@cli.command(epilog=MODEL_HELP, short_help="the strategies that fit a budget per device, best first.")
@model_options(strategy=False)
@click.option("--devices", "-n", type=click.IntRange(min=1), default=1, show_default=True, help="devices available.")
@click.option("--budget", metavar="BYTES", help="memory per device, e.g. 80GiB (default: the GPU's; --device cpu needs "
              "one).")
@click.option("--workers", type=click.IntRange(min=1), default=None, metavar="N",
              help="processes that capture the distinct steps (default: one per core; 1: in this one).")
@click.option("--json", "as_json", is_flag=True, help="print JSON.")
@handle_errors
def plan(devices, budget, workers, as_json, **kwargs):
    """The strategies whose step of MODEL fits --budget on each of --devices devices, ranked by
    the most samples per optimizer step they allow.

    \b
    Examples:
      fxmem plan gpt --size gpt2-medium --budget 24GiB --devices 4
      fxmem plan llama --size 7b --gpu A100-80GB --devices 8
    """
    opts = options(kwargs)
    _no_step(opts, "plan")
    limit = parse_budget(budget)
    import estimator

    def run(model, sample, **options):
        return estimator.plan(model, sample, limit, devices, workers=workers, **options)

    result = _estimate(opts, run)
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else str(result))


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
