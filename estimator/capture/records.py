"""What a capture is asked and what it returns.

``StepSpec`` is the question: which step to run (mode, optimizer, loss or the user's own step),
for which target, at which precision and with which strategy.  ``RawCapture`` is the answer: the
ops, storages and fx graph of one recorded step, bytes already polynomials in ``b``, with where a
real run's first step makes its state (``RunMarks``) and, for ``mode="generate"``, the model's
calls and the KV cache (``Decoding``).  ``trace.capture`` takes the one and returns the other;
``estimator.account`` turns the answer into bytes by category, op by op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import fx

from estimator.capture import compiled, steps
from estimator.capture.tracker import OpEvent, Storage
from estimator.vocab.categories import Mode
from estimator.vocab.data_dependent import Policy, Site
from estimator.vocab.strategy import DEFAULT, Strategy
from estimator.vocab.target import TargetSpec


@dataclass(frozen=True)
class StepSpec:
    """What step to run: the mode, the optimizer factory (train), the loss function, the
    target whose kernels and defaults the capture follows, the precision (autocast dtype,
    GradScaler) and the strategy (gradient accumulation, activation checkpointing)."""

    mode: Mode
    optimizer: steps.OptimizerFactory | None
    loss_fn: steps.LossFn
    target: TargetSpec = field(default_factory=TargetSpec)
    precision: steps.Precision = steps.FP32
    strategy: Strategy = DEFAULT
    data_dependent: Policy = field(default_factory=Policy)  # sizes fake tensors cannot know
    batch_dims: tuple[int, ...] | None = None  # the batch dim of each leaf of tree_flatten(sample); None: dim 0
    keep_output: bool = True  # the built-in train step keeps the model's output alive through backward
    step: steps.StepFn | None = None  # the user's own step (then `optimizer` is a StateFactory: model -> state)
    compiled: compiled.Compiled | None = None  # the model is torch.compile'd so (None: eager)
    rank: int = 0  # Strategy(mesh=): the rank whose step is captured (``capture.world``)


@dataclass(frozen=True)
class RunMarks:
    """Where in the recorded step a real run's first step makes its state (``Born``), by op index:
    ``optimizer_starts[i]``: the op optimizer ``i``'s ``step()`` starts at (None: not stepped);
    ``model_returns``: the op the built-in step's model call returns before (there the previous
    step's ``out = model(x)`` is rebound and freed; None for a user's step, whose step function
    returns before the next one starts)."""

    optimizer_starts: tuple[int | None, ...] = ()
    model_returns: int | None = None


@dataclass(frozen=True)
class Decoding:
    """``mode="generate"``: where each call of the model starts (op indices: the prefill, then one
    decode step per new token but the last), and the KV cache as the last call leaves it:
    ``bytes_per_token`` per sequence (keys and values of every layer, at the capture's dtype)
    and the ``tokens`` it has room for then (a dynamic cache: the tokens it holds; a static
    one: its length), at the sample's sequence length."""

    calls: tuple[int, ...] = ()
    bytes_per_token: int = 0
    tokens: int = 0
    cache: str = ""  # the cache's class name (DynamicCache, StaticCache, ...)
    grown: int = 0  # the tokens the cache gained at the last call (a dynamic cache: 1; a static one: 0)
    # the first call from which the cache grows as it will to the end (a sliding window full;
    # ``generation.cache_steady``); None: a cache whose growth fxmem does not know
    steady_from: int | None = 0
    layer_bytes: tuple[int, ...] = ()  # ``bytes_per_token`` by layer of the cache (``cache.layers``; () for other caches)


@dataclass
class RawCapture:
    """The events of one captured step; bytes already polynomials in ``b``."""

    ops: list[OpEvent]
    storages: dict[int, Storage]
    graph: fx.Graph
    valid_from: int  # the range of b where the capture holds (from the shape guards)
    valid_to: int | None
    guards: tuple[str, ...]
    seq_range: tuple[int, int | None] | None = None  # where the formula holds in s (s symbolic)
    grad_order: tuple[str, ...] = ()  # parameters in the order AccumulateGrad gave them a gradient
    # micro-batch byte counts (in the micro-batch's rows b) whose per-row bytes the number of
    # micro-batches does not divide: their coefficients in the step's b were rounded up
    rounded: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # how host-measured kernels were priced (CPU target)
    data_dependent: tuple[Site, ...] = ()  # the data-dependent sizes used (in b)
    freed_first: tuple[int, ...] = ()  # state freed before the first op (zero_grad() first in a user's step)
    marks: RunMarks = RunMarks()  # where a run's first step makes its state
    decoding: Decoding | None = None  # mode="generate": the model's calls and the KV cache
    managed: int = 0  # bytes of state in CUDA managed memory, outside the caching allocator (paged optimizers)
    # mode="generate", s symbolic: the guards (in b and s) each call of the model added, from its first op to
    # the next call's (``phases.decoding``'s guard marks)
    call_guards: tuple[tuple[Any, ...], ...] = ()
    # the state before the step, storage -> the name of its tensor (``StepSpec``'s state: parameters, buffers,
    # held tensors, optimizer state, what a user's step keeps by name)
    state_names: dict[int, str] = field(default_factory=dict)
    # values fake tensors cannot know came from the sample's values (shadows) or a real run (the probe): the
    # capture follows the values of the sample (and, probed, of the weights), not only their shapes
    reads_values: bool = False
    # a model on the meta device whose step read its routers' picks: the policy of their bound it was captured at
    # (``trace._routed``), where the captures of its other ranks start
    bound: Policy | None = None
    # Strategy(mesh=): the ranks grouped by the program they run, in rank order (``world.roles``)
    roles: tuple[tuple[int, ...], ...] = ()
    # what b must be a multiple of: a job's pipeline schedule's micro-batches (``trace._pipelined``)
    multiple: int = 1
    # a model's repeated blocks built from a capture of a few (``repeated_blocks.extend``): its plan and that
    # capture, from which ``report(depth_symbols=True)`` builds the step at other depths
    shallow: tuple[Any, RawCapture] | None = None
    # an eager step's own torch.compile'd regions (a parallelize function's per-block compile) took the capture's
    # symbols: their programs are the compiler's for every size, where a real run compiles for its own
    symbolic_regions: bool = False
