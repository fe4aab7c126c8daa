"""The data-dependent policy: what to assume for the sizes a fake tensor cannot know.

``report(data_dependent=...)`` as a ``Policy`` (``"max"``: the upper bound, the safe worst case;
``"sample"``: what one real forward on the sample gives, scaled per batch row; a fraction of the
bound; or values per call site), what an MoE router chooses where no real run can say
(``Routing``), and what a capture reports of each such size: a ``Site`` with its ``Source``.  The
capture applies the policy (``estimator.capture.datadep``).
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from collections.abc import Mapping
from typing import Any

from estimator.vocab.errors import InputError

MAX, SAMPLE, BALANCED = "max", "sample", "balanced"


class Routing(enum.Enum):
    """Which experts an MoE router's ``torch.topk`` picks where no real run of the router can say
    (its weights on the meta device, or ``data_dependent="balanced"``): the values a step reads from
    them (expert parallelism's token counts, which size what each rank receives) follow this."""

    FIRST = ("every token picks the same k experts, the first k: the first rank's experts receive every "
             "rank's tokens, the most any rank can receive (data_dependent='max', the safe worst case)")
    BALANCED = ("balanced: the (token, slot) pair p picks expert p mod E, so every expert and every rank "
                "receives alike (data_dependent='balanced')")


class Source(enum.Enum):
    """Where a data-dependent size's value comes from."""

    BOUND = "the upper bound (data_dependent='max', the safe worst case)"
    BUDGET = "the upper bound within a known total (one-hot rows have one 1 each)"
    FRACTION = "a fraction of the upper bound, rounded up per row"
    SAMPLE = "observed on the sample (data_dependent='sample'), scaled per batch row"
    INPUTS = ("fixed by the sample's own values (a mask, labels or lengths it holds; data_dependent='sample'), "
              "scaled per batch row")
    GIVEN = "given for this site"
    UNOBSERVED = "the upper bound: the probe on the sample did not reach this call"


@dataclasses.dataclass(frozen=True)
class Policy:
    """``report(data_dependent=...)``, checked: a default for every site and per-site values.

    ``observed``: the probe's sizes by site (``"sample"``), with the bound each had on the
    sample; ``values``: the probe's scalars by site (``.item()``); ``inputs``: its modules' integer
    tensor arguments.
    """

    default: str | float = MAX
    sites: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    observed: Mapping[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # site -> (n, upper)
    values: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # the probe's integer tensors handed to modules, by call ("<module>#<k>:<argument>"): a router's
    # expert indices, which a step parallelized over a mesh exchanges (``datadep.Probe``)
    inputs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # the probe could not run (the weights are on the meta device): "sample" sizes the sample's own
    # values do not fix are refused (``meta_weights``)
    unprobed: bool = False
    # a router's top-k picks where no real run gives them: "balanced" asks for BALANCED (without a
    # probe); a capture on meta weights that needs them takes FIRST, the bound (``trace._capture_probed``)
    routing: Routing | None = None

    @property
    def needs_probe(self) -> bool:
        return self.default == SAMPLE or SAMPLE in self.sites.values()

    @property
    def routed_bound(self) -> bool:
        """Whether the routers' picks are at their bound, which only a capture that needed them on
        meta weights takes (``trace._routed``), never a user's choice."""
        return self.routing is Routing.FIRST

    @staticmethod
    def of(value) -> Policy:
        """From ``report(data_dependent=)``: ``"max"``, ``"sample"``, ``"balanced"`` (``"max"``, a
        router's picks ``Routing.BALANCED``), a fraction in ``(0, 1]``, or a dict ``{site: "max" |
        "sample" | fraction | int}`` (``"*"``: the default, which may be ``"balanced"``)."""
        if isinstance(value, Policy):
            return value
        if value is None:
            return Policy()
        given = dict(value) if isinstance(value, Mapping) else {"*": value}
        routing = None
        if isinstance(given.get("*"), str) and given["*"].lower() == BALANCED:
            given["*"], routing = MAX, Routing.BALANCED
        if not isinstance(value, Mapping):
            return Policy(_choice(given["*"], "data_dependent", allow_int=False), routing=routing)
        sites = {str(k): _choice(v, f"data_dependent[{k!r}]", allow_int=True) for k, v in given.items()}
        return Policy(sites.pop("*", MAX), sites, routing=routing)


def _choice(value, what: str, allow_int: bool):
    if isinstance(value, str) and value.lower() in (MAX, SAMPLE):
        return value.lower()
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and allow_int:
        if value < 0:
            raise InputError(f"{what} must be ≥ 0 elements, got {value}")
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral)):
        if not (0 < float(value) <= 1):
            raise InputError(f"{what}: a fraction of the upper bound must be in (0, 1], got {value!r}")
        return float(value)
    kinds = "'max', 'sample', a fraction in (0, 1]" + (" or a number of elements" if allow_int else ", 'balanced'")
    raise InputError(f"{what} must be {kinds}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Site:
    """One data-dependent size of the step: ``0 ≤ used ≤ upper`` (sympy, shape-env symbols
    until the capture maps them to ``b``)."""

    site: str
    op: str
    upper: Any
    used: Any
    source: Source
    observed: tuple[int, int] | None = None  # (n, upper) on the sample, when probed
    in_kernel: bool = False  # asked inside a kernel's own code: it sizes that kernel's buffers alone
