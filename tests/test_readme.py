"""The README runs as written.  Its Python blocks: in order, in one session, as a reader pasting
them one after another would (a block builds on the names the ones before it made); a line that
is an expression commented with a number (``rep.max_batch()     # 44: ...``) must give that
number; a block whose first line says ``# needs a CUDA device`` runs only where there is one.
Its first command's report: the output it shows is the command's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
CUDA_ONLY = "# needs a CUDA device"
# ``expression   # 13,190,059,520: what it is``: one integer, then ':' or the end
CLAIM = re.compile(r"^(?P<expr>[^#=]+?)\s+#\s*(?P<number>\d{1,3}(?:,\d{3})+|\d+)(?::|\s*$)")

SESSION: dict = {"__name__": "readme"}


def claims(block: str) -> list[tuple[str, int]]:
    """The README's numeric claims in ``block``: (expression, the number its comment gives)."""
    found = []
    for line in block.splitlines():
        match = CLAIM.match(line)
        if match and not line.startswith((" ", "\t")):
            found.append((match["expr"].strip(), int(match["number"].replace(",", ""))))
    return found


def test_the_readme_has_the_blocks_this_test_runs():
    assert len(BLOCKS) >= 10
    assert claims("rep.max_batch()     # 44: the largest batch") == [("rep.max_batch()", 44)]
    assert claims("rep.peak    # 640*b + 8192: x 128b") == []  # a formula, not a number
    assert claims("x, y  # 69, 1024") == []


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block(index):
    block = BLOCKS[index]
    if block.lstrip().startswith(CUDA_ONLY) and not torch.cuda.is_available():
        pytest.skip("the block needs a CUDA device")
    pytest.importorskip("transformers")  # the tour's Hugging Face blocks (the test extra installs it)
    exec(compile(block, f"README.md python block {index}", "exec"), SESSION)
    for expr, number in claims(block):
        assert eval(expr, SESSION) == number, f"README block {index}: {expr} is not {number:,}"


def test_the_first_commands_report_begins_as_the_readme_shows():
    command = re.search(r"```bash\n.*?&& (fxmem report [^\n]*)\n", README.read_text(), re.DOTALL)[1]
    shown = re.search(r"```text\n(.*?)```", README.read_text(), re.DOTALL)[1].splitlines()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "estimator", *command.split()[1:]], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=env, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[:len(shown)] == shown
