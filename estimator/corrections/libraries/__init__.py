"""Corrections for third-party libraries' own ops, loaded only where the library is.

fxmem never imports an optional library to register its entries (importing bitsandbytes or
torchao costs seconds and the ops' names exist only once they are): ``load_imported()`` runs
at the start of each capture and imports this package's module for every library of
``LIBRARIES`` that the process has imported (the user's model or optimizer did), once.  Each
module registers its entries in the one registry (``estimator.corrections.registry``), citing
the library's source file as every entry does.
"""

from __future__ import annotations

import importlib
import sys

# library (its top-level module) -> fxmem's module of entries for its ops
LIBRARIES = {
    "bitsandbytes": "estimator.corrections.libraries.bitsandbytes",
    "torch.distributed.fsdp": "estimator.corrections.libraries.fsdp",
    "torchao.optim.cpu_offload": "estimator.corrections.libraries.torchao",
}


def load_imported() -> tuple[str, ...]:
    """Register the entries of every library of ``LIBRARIES`` imported in this process (each
    once); returns the libraries whose entries are registered."""
    loaded = []
    for library, module in LIBRARIES.items():
        if library in sys.modules:
            importlib.import_module(module)
            loaded.append(library)
    return tuple(loaded)
