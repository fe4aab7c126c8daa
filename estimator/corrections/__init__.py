"""Per-op corrections, one registry (``registry.py``); the entries live by op family.

Importing this package registers every entry.
"""

from estimator.corrections.registry import NO_FIX, Fix, bind, correction, lookup, registered
from estimator.corrections import conv, loss, norm, rnn  # noqa: F401  (registers the entries)

__all__ = ["NO_FIX", "Fix", "bind", "correction", "lookup", "registered"]
