"""Every notebook executes top to bottom (its own asserts check what it shows), from anywhere.

The kernel's working directory is a fresh temporary one, so a notebook that finds its files
relative to where it is run (rather than through the package) fails here. A notebook whose
metadata says `"jaxengine": {"slow": true}` (one that compiles a real model) runs only with the
slow tests.
"""

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from jaxengine.loading import tiny_model_path

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
# The notebooks whose results are pictures (issue 35: what a person would rather see than read).
DRAWS = {"quickstart.ipynb", "jit_generate.ipynb", "gradients.ipynb", "policy_lab.ipynb",
         "policy_experiments.ipynb", "scheduling_timeline.ipynb"}


def _is_slow(path: Path) -> bool:
    return bool(nbformat.read(path, as_version=4).metadata.get("jaxengine", {}).get("slow"))


def _cases() -> list:
    return [pytest.param(p.name, marks=[pytest.mark.slow] if _is_slow(p) else [])
            for p in sorted(NOTEBOOKS.glob("*.ipynb"))]


def _execute(path: Path, cwd: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


@pytest.mark.parametrize("name", _cases())
def test_notebook_runs_from_another_directory(name, tmp_path):
    nb = _execute(NOTEBOOKS / name, tmp_path)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any((o.output_type == "stream" and o.text.strip()) or o.output_type == "display_data"
               for o in outputs)
    pictures = [o for o in outputs if "image/png" in o.get("data", {})]
    assert pictures or name not in DRAWS, f"{name} draws nothing"


def test_each_notebook_opens_with_what_it_shows_and_how_long_it_takes():
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        first = nbformat.read(path, as_version=4).cells[0]
        assert first.cell_type == "markdown" and first.source.startswith("# "), path.name
        assert re.search(r"\b\d+(\.\d+)? ?(s|seconds?|min|minutes?)\b", first.source), (
            f"{path.name} does not say how long it takes to run")


def test_the_notebooks_tiny_model_is_found_through_the_package(tmp_path, monkeypatch):
    # In a checkout the notebooks run on the tiny fixture, whatever the working directory;
    # None here would send them to the embedded SmolLM2 (minutes instead of seconds).
    monkeypatch.chdir(tmp_path)
    assert tiny_model_path() == str(NOTEBOOKS.parent / "tests" / "fixtures" / "tiny"
                                    / "llama_tied_mha")
