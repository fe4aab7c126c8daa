"""The generated model pages (docs/models, ``python -m validators.pages``) are up to date.

Regenerating every model's ``debug`` section (Markdown only, no plots: about 20 s) must give
the committed pages and index byte for byte; the real sizes' sections take minutes and are
kept as committed (they are rebuilt by ``python -m validators.pages``).  A failure means the
estimator's numbers or the page layout changed: run ``python -m validators.pages`` (or
``--sizes debug`` when only the debug sections changed) and commit docs/models.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

import models_zoo
from estimator.corrections.cpu import host as cpu
from validators import pages

DOCS = Path(__file__).resolve().parent.parent / "docs" / "models"
STALE = "docs/models is stale: run `python -m validators.pages` and commit the result"


@pytest.fixture(scope="module")
def regenerated():
    return pages.generate(sizes=["debug"], out=DOCS, plots=False)


def test_every_model_and_size_has_a_committed_page():
    for name in models_zoo.names():
        page = DOCS / f"{name}.md"
        assert page.exists(), STALE
        sections = pages.parse_sections(page.read_text())
        assert list(sections) == models_zoo.sizes(name), STALE
        for size in models_zoo.sizes(name):
            for png in pages.png_names(name, size):
                assert (DOCS / png).exists(), f"{png} missing: {STALE}"


def _from_another_host(text: str) -> bool:
    """A page with CPU kernels measured on the host (convolutions, ...) holds that host's numbers:
    it can be compared only on the host that wrote it (its notes name the host)."""
    return "measured on this host" in text and f"measured on this host ({cpu.host_text()})" not in text


def _from_another_release(text: str) -> bool:
    """A page whose model code comes from a package (transformers' Mixtral) holds the numbers of
    the release that wrote it (its header names it): compared only under that release."""
    found = re.search(rf"^{pages.BUILT_WITH} (\S+) (\S+) ", text, re.MULTILINE)
    return found is not None and importlib.metadata.version(found[1]) != found[2]


def test_debug_sections_and_index_are_up_to_date(regenerated):
    assert set(regenerated) == {DOCS / f"{name}.md" for name in models_zoo.names()} | {DOCS / "index.md"}
    elsewhere = [path.name for path in regenerated
                 if _from_another_host(path.read_text()) or _from_another_release(path.read_text())]
    for path, text in regenerated.items():
        if path.name in elsewhere or (path.name == "index.md" and elsewhere):
            continue  # another host's measurements or release's model (the index shows every page's numbers)
        assert path.read_text() == text, f"{path.name}: {STALE}"


def test_sections_round_trip():
    text = (DOCS / "mlp.md").read_text()
    sections = {size: body for size, (_, body) in pages.parse_sections(text).items()}
    assert pages.render_page("mlp", sections) == text
    info = pages.parse_sections(text)["debug"][0]
    assert info["size"] == "debug" and info["batch"] == pages.BATCH and info["peak_bytes"] > 0


def test_a_page_names_the_release_of_its_models_package():
    assert f"{pages.BUILT_WITH} transformers " in (DOCS / "mixtral.md").read_text()
    line = lambda version: f"{pages.BUILT_WITH} transformers {version} (its model code: ...)."
    assert not _from_another_release(line(importlib.metadata.version("transformers")))
    assert _from_another_release(line("0.0.1"))
    assert pages.BUILT_WITH not in (DOCS / "mlp.md").read_text()  # the zoo's own code


def test_select_sizes():
    assert pages.select_sizes("resnet", None) == ["debug", "resnet18", "resnet50"]
    assert pages.select_sizes("resnet", ["real"]) == ["resnet18", "resnet50"]
    assert pages.select_sizes("resnet", ["debug", "resnet50"]) == ["debug", "resnet50"]
    assert pages.select_sizes("resnet", ["7b"]) == []
