"""The model one unit of its repeated blocks deeper, as its config says (``deepen``), for
``report(depth_symbols=True)`` to check its formula against: the capture builds the step one
unit deeper from the few blocks it captured, which cannot see code outside the blocks that
follows their number through the config (a loop over its ``layer_types``); the shallow copy of
the model one unit deeper (``repeated_blocks.shallow(model, deeper, own)``), given a config
that says so, runs that code as that model would (``trace.capture(deeper=True)``)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from torch import nn

from estimator.capture import repeated_blocks

NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")  # a config's number of blocks, by its names


def deepen(copy_: nn.Module, plan_: repeated_blocks.Plan) -> bool:
    """Give the modules ``repeated_blocks.shallow`` copied for ``copy_`` (on the path to the
    blocks) a config that says the model has one unit of ``plan_`` (the model's own) more: its
    number of blocks (``NAMES``), its lists per block (``layer_types``) or of block indices
    (``mlp_only_layers``) with the template unit's entries once more before the last two units,
    where the extension puts its copies.  Code outside the blocks that follows the depth then
    runs as in that model; the user's config is not changed.  False where no config names the
    depth (nothing changed)."""
    at = plan_.block(plan_.real_unit(repeated_blocks.NEXT), 0)  # where the new unit goes
    first = plan_.block(plan_.real_unit(repeated_blocks.TEMPLATE), 0)
    template = range(first, first + plan_.period)

    def deeper(config: Any) -> Any:
        changes = {n: getattr(config, n) + plan_.period for n in NAMES if getattr(config, n, None) == plan_.blocks}
        if not changes:
            return None
        fields = vars(config) if hasattr(config, "__dict__") else {}
        for name, value in fields.items():
            if not isinstance(value, (list, tuple)) or not value or name in changes:
                continue
            if len(value) == plan_.blocks:  # one entry per block (as ``_per_layer`` reads them)
                changes[name] = type(value)([*value[:at], *(value[i] for i in template), *value[at:]])
            elif all(type(i) is int for i in value):  # indices of blocks
                moved = [i + plan_.period if i >= at else i for i in value]
                changes[name] = type(value)(sorted(moved + [at + i - first for i in template if i in value]))
        # a copy with these attributes set, every other one kept: dataclasses.replace would build a new one
        # from the fields alone and lose what is set after (transformers' _attn_implementation_internal)
        config = copy.copy(config)
        for name, value in changes.items():
            try:
                setattr(config, name, value)  # (through a config's own aliases: GPT-2's num_hidden_layers)
            except dataclasses.FrozenInstanceError:
                object.__setattr__(config, name, value)
        return config

    made: dict[int, Any] = {}
    for twin, _ in repeated_blocks.twins(copy_):
        for name in ("config", "cfg"):
            config = twin.__dict__.get(name)
            if config is not None and id(config) not in made:
                made[id(config)] = deeper(config)
            if made.get(id(config)) is not None:
                twin.__dict__[name] = made[id(config)]
    return any(c is not None for c in made.values())
