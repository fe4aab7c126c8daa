"""What a byte of memory is for, and when in the step it was allocated."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Category(str, enum.Enum):
    """Memory categories (as in PyTorch's MemTracker `_MemRefType`, plus inputs)."""

    PARAMETER = "parameters"
    BUFFER = "buffers"
    INPUT = "inputs"
    GRADIENT = "gradients"
    OPTIMIZER_STATE = "optimizer state"
    COMMUNICATION = "communication buffers"  # distributed strategies: DDP buckets, gathered shards, ...
    ACTIVATION = "activations"  # saved for backward by autograd
    KV_CACHE = "KV cache"  # mode="generate": the keys and values a decoder's cache holds
    TEMPORARY = "temporaries"  # everything else allocated during the step


class Phase(str, enum.Enum):
    """Where in the step an op runs. The loss belongs to the forward phase."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


class Mode(str, enum.Enum):
    TRAIN = "train"
    INFERENCE = "inference"
    GENERATE = "generate"  # transformers' model.generate(): prefill, then one decode step per new token


class Target(str, enum.Enum):
    """The device whose memory is predicted.  The capture always runs on fake CPU tensors; the
    target decides which per-op rules apply (``estimator.corrections``)."""

    CPU = "cpu"
    CUDA = "cuda"


class Birth(str, enum.Enum):
    """When a tensor alive before the step came to be, in a run from a cold start (the CUDA
    target replays a run: ``estimator.devices.cuda``)."""

    LOAD = "model load"  # parameters and buffers: model.to(device), in Module._apply's order
    SETUP = "setup"  # built before the first step: optimizer state made by the constructor, an EMA copy
    BATCH = "batch"  # the step's inputs: a new batch every step
    BACKWARD = "first backward"  # gradients a step keeps, a GradScaler's scale: made by the first step
    OPTIMIZER = "first optimizer step"  # optimizer state made lazily by the first optimizer.step()


@dataclass(frozen=True)
class Born:
    """``Birth`` and an order: LOAD: the position in ``Module._apply``'s walk; OPTIMIZER: which
    optimizer (its index in the step's optimizers)."""

    when: Birth
    order: int = 0
