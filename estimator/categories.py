"""What a byte of memory is for, and when in the step it was allocated."""

from __future__ import annotations

import enum


class Category(str, enum.Enum):
    """Memory categories (as in PyTorch's MemTracker `_MemRefType`, plus inputs)."""

    PARAMETER = "parameters"
    BUFFER = "buffers"
    INPUT = "inputs"
    GRADIENT = "gradients"
    OPTIMIZER_STATE = "optimizer state"
    COMMUNICATION = "communication buffers"  # distributed strategies: DDP buckets, gathered shards, ...
    ACTIVATION = "activations"  # saved for backward by autograd
    TEMPORARY = "temporaries"  # everything else allocated during the step


class Phase(str, enum.Enum):
    """Where in the step an op runs. The loss belongs to the forward phase."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


class Mode(str, enum.Enum):
    TRAIN = "train"
    INFERENCE = "inference"


class Target(str, enum.Enum):
    """The device whose memory is predicted.  The capture always runs on fake CPU tensors; the
    target decides which per-op rules apply (``estimator.corrections``)."""

    CPU = "cpu"
    CUDA = "cuda"
