"""The floor plan of ``estimator/``, written down as data and checked on every run.

Each room (a subpackage, or a module of the package root) belongs to one stage; a module imports
only from its own room or from rooms of lower stages, function-local imports included.  Rooms of
one stage do not import each other, so the room-level import graph has no cycle.  docs/design.md
("Layout") explains each room; a new file goes in the room of the stage it works in.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "estimator"

# Bottom first.  "faces" is the package root's modules (report(), compare/plan, the monitor): the
# public API; the integrations build models from other libraries and call that API (Trainer,
# TrainingArguments); the command line calls both.
STAGES: tuple[tuple[str, ...], ...] = (
    ("vocab",),  # descriptions only: the request, strategies, targets, GPUs, allocator options, units, errors
    ("corrections",),  # per-op knowledge (one registry) and the host-kernel measurements it prices with
    ("capture",),  # the step run on fake tensors, recorded
    ("account",),  # events -> bytes by category, op by op
    ("devices", "ranks"),  # after the capture: the CUDA device (allocator replay, workspaces), each rank's step
    ("reporting",),  # the Report and its renderings
    ("orchestrate",),  # which captures one report needs, and how they combine
    ("faces",),  # report(), compare/plan, the monitor
    ("integrations",),  # models from transformers, timm, torchvision; Trainer and TrainingArguments
    ("cli",),  # the fxmem command line and its MODEL argument
)
STAGE = {room: i for i, rooms in enumerate(STAGES) for room in rooms}
MAX_LINES = 750  # "about 700": a file past it does several jobs
WHOLE = {"devices/cuda_allocator.py"}  # one model of one C++ class, function by function: kept whole


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["estimator", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def room(module: str) -> str:
    parts = module.split(".")
    if module == "estimator.__main__":  # python -m estimator is the command line
        return "cli"
    return parts[1] if len(parts) > 1 and parts[1] in STAGE else "faces"


def imports(module: str) -> set[str]:
    """Every estimator module ``module`` imports, at any depth of its code."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in MODULES and m != module}


def _allowed(importer: str, imported: str) -> bool:
    a, b = room(importer), room(imported)
    return a == b or STAGE[b] < STAGE[a]


def test_every_room_has_a_stage():
    rooms = {p.name if p.is_dir() else p.stem for p in PACKAGE.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem not in ("__init__",
                                                                                                      "__main__"))}
    unstaged = sorted(r for r in rooms if room(f"estimator.{r}") == "faces" and r not in STAGE
                      and (PACKAGE / r).is_dir())
    assert not unstaged, f"packages with no stage in STAGES: {unstaged}"


def test_no_lower_stage_imports_a_higher_one():
    wrong = sorted(f"{m} ({room(m)}) imports {i} ({room(i)})" for m in MODULES for i in imports(m)
                   if not _allowed(m, i))
    assert not wrong, "\n".join(wrong)


def test_the_room_graph_has_no_cycle():
    edges = {(room(m), room(i)) for m in MODULES for i in imports(m) if room(m) != room(i)}
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen))
                   for n in graph.get(start, ()))

    cycles = sorted(r for r in graph if reaches(r, r, set()))
    assert not cycles, f"rooms on an import cycle: {cycles}"


@pytest.mark.parametrize(("importer", "imported", "ok"), [
    ("estimator.capture.trace", "estimator.corrections.registry", True),
    ("estimator.corrections.masks", "estimator.capture.datadep", False),  # the seam is corrections.data_sizes
    ("estimator.vocab.target", "estimator.devices.cuda_allocator", False),  # options live in vocab
    ("estimator.ranks.fsdp", "estimator.devices.cuda", False),  # siblings of one stage
    ("estimator.cli.commands", "estimator.integrations.transformers", True),
    ("estimator.integrations.training_args", "estimator.api", True),  # TrainingArguments -> report()
    ("estimator.api", "estimator.integrations.transformers", False),
    ("estimator.ranks.fsdp", "estimator.ranks.rankstep", True),
])
def test_the_rule_itself(importer, imported, ok):
    """The checker refuses what the plan forbids (it cannot pass by allowing everything)."""
    assert _allowed(importer, imported) is ok


def test_no_file_does_several_jobs():
    long = sorted(f"{p.relative_to(PACKAGE)}: {n} lines" for p in PACKAGE.rglob("*.py")
                  if (n := len(p.read_text().splitlines())) > MAX_LINES and str(p.relative_to(PACKAGE)) not in WHOLE)
    assert not long, "split these at their seams:\n" + "\n".join(long)
