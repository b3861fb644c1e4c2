"""The README's Python examples run as pasted (issue 35).

Each ```python block runs in a fresh interpreter whose working directory is a temporary one.
The blocks that load the embedded SmolLM2 (about a minute of loading and compiling on a CPU)
run with the slow tests; the scheduler's runs in the default set.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
# Each Python block by the heading it follows; a block that loads the real model is slow.
BLOCKS = {
    "Python in ten lines": True,
    "Generation inside your own jit": True,
    "Gradients, and serving the trained weights": True,
    "The scheduler is a pure state machine": False,
}


def python_blocks() -> dict[str, str]:
    """{heading: code} of the README's ```python blocks (one per section or subsection)."""
    blocks: dict[str, str] = {}
    for section in re.split(r"^###? ", README.read_text(), flags=re.M)[1:]:
        heading = section.splitlines()[0].strip()
        for code in re.findall(r"^```python\n(.*?)^```", section, flags=re.M | re.S):
            assert heading not in blocks, f"two python blocks under {heading!r}"
            blocks[heading] = code
    return blocks


def test_every_python_block_is_run_here():
    assert set(python_blocks()) == set(BLOCKS)


@pytest.mark.parametrize("heading", [
    pytest.param(h, marks=[pytest.mark.slow] if slow else []) for h, slow in BLOCKS.items()])
def test_readme_block_runs_as_pasted(heading, tmp_path):
    code = python_blocks()[heading]
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, f"README block under {heading!r} failed:\n{run.stderr[-3000:]}"
