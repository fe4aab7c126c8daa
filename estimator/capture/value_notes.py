"""The report's notes on what a capture could not know from fake tensors: each data-dependent
size (its site, range, the value used and why: ``notes``) and the values read that no rule of
the capture computes from the sample -- taken as 0.0 (``assumed_note``), given by the probe's real
run (``host_note``), brought by collectives (``exchanged_note``) or following a router's assumed
picks (``routed_note``).  The sites are ``datadep``'s."""

from __future__ import annotations

from estimator.vocab.data_dependent import Routing, Site


def _lines(keys) -> str:
    """The user's lines of value sites (``"<module>:<op>@<file:line>#<k>"``), each once."""
    return ", ".join(dict.fromkeys(key.partition("@")[2].rpartition("#")[0] for key in keys))


def assumed_note(keys) -> tuple[str, ...]:
    """The note on floating-point values the capture answered with 0.0."""
    if not keys:
        return ()
    where = _lines(keys)
    return (f"{len(keys)} floating-point value(s) read with .item()/float() (at {where}) were taken as 0.0: "
            "fake tensors have no values; memory does not depend on a value that is logged or compared, but a "
            "step that branches on it may allocate otherwise",)


def exchanged_note(keys, routed: bool = False) -> tuple[str, ...]:
    """The note on values a collective brought from the other ranks (``shadows.py``); ``routed``:
    the router's picks they follow were assumed (``routed_note``)."""
    if not keys:
        return ()
    how = "as the note on the router's picks says)" if routed else (
        "as the sample's are routed, by the weights as given: training moves the routing). Exact when the ranks' "
        "batches route alike; where they differ, a rank may receive more (its experts' tokens: up to every "
        "rank's), which this does not bound")
    return (f"{len(keys)} value(s) read at {_lines(keys)} came from the other ranks through collectives (an "
            "all-to-all of expert parallelism's token counts, an all-reduce of a token count): taken as in a job "
            f"whose every rank holds this rank's values (here: routes its tokens {how}",)


def host_note(keys) -> tuple[str, ...]:
    """The note on values host code read (``.numpy()``) that the probe's real run gave."""
    if not keys:
        return ()
    where = _lines(keys)
    return (f"{len(keys)} tensor value(s) read on the host with .numpy() (at {where}) are those of a real forward of "
            "the model on the sample (the probe): sizes host code derives from them (a matching's indices) follow "
            "this sample's values",)


_MANY_MODULES = 8  # more modules than this with one data-dependent op share one note


def _merged_note(op: str, source, modules: list[str], group: list[Site]) -> str:
    uppers = ", ".join(sorted({str(g.upper) for g in group}, key=lambda u: (len(u), u)))
    used = sorted({str(g.used) for g in group}, key=lambda u: (len(u), u))
    return (f"data-dependent sizes of {op} in {len(modules)} modules ({modules[0]} … {modules[-1]}), {len(group)} "
            f"calls: 0 ≤ n ≤ {uppers}; used n = {', '.join(used)}, {source.value}. Override per call, e.g. "
            f"report(..., data_dependent={{{group[0].site!r}: n, ...}}), or for all with a fraction: "
            "data_dependent=0.01")


def notes(sites: tuple[Site, ...]) -> tuple[str, ...]:
    """The data-dependent sizes used, one note per module and op whose calls share a bound and a
    source (an MoE layer's experts): the sites, the range, the values used and why."""
    groups: dict[tuple, list[Site]] = {}
    for site in sites:
        module, _, rest = site.site.rpartition(":")
        groups.setdefault((module, rest.split("#")[0], str(site.upper), site.source), []).append(site)
    modules: dict[tuple, list[str]] = {}  # (op, source) -> its modules
    for module, op, _, source in groups:
        modules.setdefault((op, source), []).append(module)
    out, merged = [], set()
    for (module, op, upper, source), group in groups.items():
        many = modules[op, source]
        if len(many) > _MANY_MODULES:  # every quantized linear of a model: one note for the op
            if (op, source) not in merged:
                merged.add((op, source))
                out.append(_merged_note(op, source, many, [s for s in sites if s.op == op and s.source is source]))
            continue
        ks = [int(g.site.rpartition("#")[2]) for g in group]
        calls = f"#{ks[0]}" if len(ks) == 1 else (
            f"#{ks[0]}–#{ks[-1]}" if ks == list(range(ks[0], ks[-1] + 1)) else "#" + ", #".join(map(str, ks)))
        used = sorted({str(g.used) for g in group})
        used = used[0] if len(used) == 1 else ", ".join(str(g.used) for g in group)
        seen = [g.observed for g in group if g.observed is not None]
        seen = "; on the sample " + ", ".join(f"{n:,}" for n, _ in seen) + f" of {seen[0][1]:,}" if seen else ""
        each = " each" if len(group) > 1 else ""
        out.append(f"data-dependent size{'s' if len(group) > 1 else ''} {module}:{op}{calls}: 0 ≤ n ≤ {upper}{each}; "
                   f"used n = {used}, {source.value}{seen}. Override with "
                   f"report(..., data_dependent={{{group[0].site!r}: n, ...}})")
    return tuple(out)


def routed_note(keys, routing: Routing | None) -> tuple[str, ...]:
    """The note on values read (by site) that follow a router's picks assumed by ``routing``
    (``routing.py``)."""
    if not keys:
        return ()
    other = ("data_dependent='balanced' assumes picks spread evenly instead" if routing is Routing.FIRST else
             "a router that favours some experts sends their ranks more, up to every rank's tokens: "
             "data_dependent='max' (the default on meta weights) gives that bound")
    return (f"{len(keys)} value(s) read at {_lines(keys)} follow the experts an MoE router picks (torch.topk over "
            "scores that follow its weights), which no real run gives here (weights on the meta device, or "
            f"data_dependent='balanced'): taken as {routing.value}; {other}",)
