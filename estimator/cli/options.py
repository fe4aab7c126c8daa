"""The options every estimating command shares, and their parsing into ``estimator.report``'s
arguments.

``model_options`` puts MODEL and the model, target and step options on ``report``, ``formula``
and ``fit``, with the strategy options and ``--keep-output`` (``compare`` and ``plan`` take
neither, and hide ``--step``, ``--generate`` and ``--cache``); ``options`` gathers what a
command parsed into an ``Options`` and refuses the combinations that cannot be (``--gpu`` with
``--device cpu``, ``--generate`` with a training strategy).  The other functions turn one
option's text into what the API takes: ``strategy`` (a ``Strategy``), ``dynamic`` (``--seq``),
``batch_dims``, ``data_dependent``, ``parse_budget`` (bytes), ``parse_strategy`` (``compare
--strategy``), ``user_function`` and ``optimizer`` (the user's ``--step`` / ``--optimizer``
functions, loaded as a MODEL factory is).  Their errors name the option (exit 2).

Nothing here imports torch: ``fxmem --help`` stays fast.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import click

MODES = ("train", "inference", "generate")
DEVICES = ("cpu", "cuda")
QUANTIZE = ("nf4", "nf4-dq", "fp4", "fp4-dq", "int8")  # --quantize: estimator.integrations.bitsandbytes.config

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
    mesh: str | None
    parallelize: str | None
    keep_output: bool | None
    generate: int | None
    cache: str | None
    seq_len: int | None
    quantize: str | None
    lora: int | None


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
        click.option("--quantize", type=click.Choice(tuple(QUANTIZE), case_sensitive=False), metavar="MODE",
                     help="a transformers model's linear weights in bitsandbytes 4-bit or 8-bit, as from_pretrained("
                          "quantization_config=BitsAndBytesConfig(...)) loads them (sized without the weights): "
                          "nf4, nf4-dq (double quantization), fp4, fp4-dq (4-bit compute dtype: --dtype, else bf16), "
                          "int8.  A Hub model quantized already (quantization_config in its config.json) needs none."),
        click.option("--lora", type=click.IntRange(min=1), metavar="R",
                     help="train LoRA adapters of rank R instead of the model (PEFT's LoraConfig(r=R): its default "
                          "target modules for a transformers model it knows, else every linear layer), the rest "
                          "frozen; with --quantize nf4-dq: QLoRA."),
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
                 "bound), sample (observed on the sample; real weights, so --device-init cpu), balanced (max, "
                 "and an MoE router's picks spread evenly where expert parallelism reads them), a fraction "
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
DEPTH_SYMBOLS_HELP = ("also the formula in the number of blocks L of the model's repeated blocks, built from the "
                      "capture that builds its depth (exact from six units of blocks on).")
STRATEGY_OPTIONS = [
    click.option("--accumulate", type=click.IntRange(min=1), default=1, metavar="K",
                 help="gradient accumulation over K micro-batches of b/K."),
    click.option("--checkpoint", metavar="MODULES",
                 help="activation checkpointing: a module type (Block), path (transformer.h.0) or glob (transformer.h.*)."),
    click.option("--data-parallel", "--dp", "data_parallel", type=click.IntRange(min=1), default=1, metavar="N",
                 help="data parallel over N devices (DDP; each runs b samples)."),
    click.option("--zero", type=click.Choice(("1", "2", "3")), help="ZeRO stage over the --dp devices "
                 "(1: ZeroRedundancyOptimizer, 2/3: FSDP2 fully_shard, reshard_after_forward False/True)."),
    click.option("--pipeline", type=click.IntRange(min=1), default=1, metavar="S",
                 help="pipeline over S stages (with --dp N: N pipelines, each stage's replicas under DDP; a pipeline "
                      "of FSDP2 stages: --mesh pp=S,dp_shard=N with your --parallelize returning its schedule)."),
    click.option("--microbatches", type=click.IntRange(min=1), metavar="M", help="pipeline micro-batches (default S)."),
    click.option("--schedule", type=click.Choice(("1f1b", "gpipe"), case_sensitive=False), default="1f1b",
                 show_default=True,
                 help="pipeline schedule."),
    click.option("--master-weights", is_flag=True,
                 help="fp32 master weights for low-precision parameters (with --dtype bf16 / fp16)."),
    click.option("--mesh", metavar="DIM=N,...",
                 help="the job's device mesh, outermost dim first (dp_shard=4,tp=2: 8 ranks), with --parallelize: "
                      "each rank's step as your parallelize function makes it (without it: a transformers "
                      "model's own tensor-parallel and FSDP plans)."),
    click.option("--parallelize", metavar="FILE.py:FUNC",
                 help="your parallelize function, FUNC(model, mesh) (fully_shard, parallelize_module, ...; cutting "
                      "the model to the rank's pipeline stage and returning its schedule), run on a fake process group "
                      "of --mesh's size; also package.module:FUNC."),
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


def strategy(opts: Options, model):
    """The ``Strategy`` of the command-line options (``--checkpoint Block``: the module type of
    that name in ``model``; ``--mesh`` without ``--parallelize``: a transformers model's own plans)."""
    from estimator.vocab.strategy import Strategy

    mesh = parse_mesh(opts.mesh)
    parallelize = user_function(opts.parallelize, "--parallelize", "a function parallelize(model, mesh)")
    if mesh is not None and parallelize is None:
        parallelize = _own_plans(model, opts.mesh)
    return Strategy(
        accumulate=opts.accumulate, checkpoint=_module_type(opts.checkpoint, model), data_parallel=opts.data_parallel,
        sharding=None if opts.zero is None else f"zero{opts.zero}", pipeline=opts.pipeline,
        microbatches=opts.microbatches, schedule=opts.schedule, master_weights=opts.master_weights,
        compile=True if opts.compile_mode == "default" else opts.compile_mode or False,
        mesh=mesh, parallelize=parallelize,
    )


def _own_plans(model, mesh: str):
    """``estimator.own_plans`` for a model that carries parallel plans (a transformers model's
    ``base_model_tp_plan``), else an error saying what ``--mesh`` needs."""
    from estimator.capture import model_plans
    from estimator.vocab.errors import InputError

    if not model_plans.carries_plans(model):
        raise InputError(f"--mesh {mesh} runs your parallelize function on each rank: give --parallelize "
                         f"FILE.py:FUNC (FUNC(model, mesh)); {type(model).__name__} carries no parallel plan of its "
                         "own (a transformers model with config.base_model_tp_plan needs none)")
    return model_plans.own_plans


def parse_mesh(text: str | None) -> dict[str, int] | None:
    """``--mesh dp_shard=4,tp=2`` -> ``{"dp_shard": 4, "tp": 2}``."""
    if text is None:
        return None
    from estimator.vocab.errors import InputError

    mesh = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, size = item.partition("=")
        if not sep or not name.strip() or not size.strip().isdigit():
            raise InputError(f"--mesh {text!r}: expected DIM=N items, e.g. dp_shard=4,tp=2; got {item!r}")
        mesh[name.strip()] = int(size)
    return mesh


def options(kwargs) -> Options:
    defaults = {"accumulate": 1, "checkpoint": None, "data_parallel": 1, "zero": None, "pipeline": 1,
                "microbatches": None, "schedule": "1f1b", "master_weights": False, "compile_mode": None, "keep_output": None,
                "generate": None, "cache": None, "mesh": None, "parallelize": None}
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


def user_function(text: str | None, flag: str, what: str):
    """``--step FILE.py:FUNC`` (or ``package.module:FUNC``): the function, loaded as a MODEL
    factory is; its errors name the flag."""
    if text is None:
        return None
    from estimator.cli import models
    from estimator.vocab.errors import InputError

    try:
        return models.load_function(text, what)
    except InputError as exc:
        raise InputError(f"{flag}: {exc}") from None


def optimizer(text: str | None, user_step: bool):
    """``--optimizer``: a name (default adamw), ``none``, or ``FILE.py:FUNC``, a function of the
    user's (``params -> Optimizer``; with ``--step``, ``model -> state``)."""
    if text is None:
        return "adamw"
    if text.strip().lower() == "none":
        return None
    if ":" not in text:
        return text
    what = "a function make_state(model) -> state" if user_step else "a function make(params) -> Optimizer"
    return user_function(text, "--optimizer", what)


def data_dependent(specs: tuple[str, ...]):
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


def dynamic(specs: tuple[str, ...]) -> dict | None:
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


def batch_dims(specs: tuple[str, ...]):
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


def parse_budget(text: str | None) -> int | None:
    """Bytes of ``--budget``, parsed before any capture (a typo fails in no time)."""
    if text is None:
        return None
    from estimator.vocab.units import parse_bytes

    return parse_bytes(text)


def _module_type(checkpoint, model):
    """``--checkpoint Block``: the module type of that name in ``model``; a path or glob (or
    anything that names no type) unchanged."""
    if not isinstance(checkpoint, str):
        return checkpoint
    types = {type(m).__name__: type(m) for m in model.modules()}
    return types.get(checkpoint, checkpoint)


def parse_strategy(spec: str, model):
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
