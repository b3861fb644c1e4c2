"""Every notebook executes top to bottom (its own asserts check what it shows).

A notebook whose metadata says `"jaxengine": {"slow": true}` (one that compiles a real model)
runs only with the slow tests.
"""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def _is_slow(path: Path) -> bool:
    return bool(nbformat.read(path, as_version=4).metadata.get("jaxengine", {}).get("slow"))


def _cases() -> list:
    return [pytest.param(p.name, marks=[pytest.mark.slow] if _is_slow(p) else [])
            for p in sorted(NOTEBOOKS.glob("*.ipynb"))]


def _execute(path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


@pytest.mark.parametrize("name", _cases())
def test_notebook_runs(name):
    nb = _execute(NOTEBOOKS / name)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any((o.output_type == "stream" and o.text.strip()) or o.output_type == "display_data"
               for o in outputs)
