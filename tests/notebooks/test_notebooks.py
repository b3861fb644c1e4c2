"""Every notebook executes top to bottom (its own asserts check what it shows)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
# Notebooks that need only the scheduler; engine notebooks compile a model and are slow.
FAST = ["scheduling_timeline.ipynb", "policy_experiments.ipynb"]


def _execute(path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


@pytest.mark.parametrize("name", FAST)
def test_scheduler_notebooks_run(name):
    nb = _execute(NOTEBOOKS / name)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any(o.output_type == "stream" and o.text.strip() for o in outputs)


def test_every_notebook_is_tested():
    tested = set(FAST) | set(SLOW)
    assert {p.name for p in NOTEBOOKS.glob("*.ipynb")} <= tested


SLOW: list[str] = []
