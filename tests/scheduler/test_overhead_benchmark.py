"""The overhead benchmark script runs (on a small trace) and prints its table and summary."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scheduler_overhead.py"


def test_benchmark_runs_on_small_traces():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--traces", "tight,prefix", "--requests", "30"],
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["trace", "steps"]
    assert lines[1].startswith("tight") and lines[2].startswith("prefix")
    assert int(lines[2].split()[-1]) > 0  # the shared 512-token prefix is hit
    assert lines[-1].startswith("summary: worst trace mean")


def test_benchmark_runs_every_trace_under_a_chosen_policy():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--traces", "tight", "--requests", "20", "--repeat", "1",
         "--policy", "srpf"],
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    assert out.splitlines()[1].startswith("tight")
    refused = subprocess.run([sys.executable, str(SCRIPT), "--policy", "lifo"],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "invalid choice: 'lifo'" in refused.stderr
