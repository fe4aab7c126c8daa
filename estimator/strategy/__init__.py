"""Training strategies: the ``Strategy`` description (``spec``) and what each does to the
captured step -- single-process settings while capturing (``checkpointing``), per-device
steps afterwards (``ranks``)."""

from estimator.strategy.spec import DEFAULT, Schedule, Sharding, Strategy, blocks, checkpointing, select

__all__ = ["DEFAULT", "Schedule", "Sharding", "Strategy", "blocks", "checkpointing", "select"]
