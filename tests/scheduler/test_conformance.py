"""Replay reproduces vLLM's recorded steps exactly on the twenty conformance traces."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from scheduler.replay import replay

CONFORMANCE = Path(__file__).resolve().parent / "conformance"
TRACES = sorted(CONFORMANCE.glob("c*[0-9].json"))


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _normalized(records):
    return [(r["step"], list(r["num_scheduled_tokens"].items()), sorted(r["preempted"]),
             sorted(r["finished"]), r["num_free_blocks"]) for r in records]


def test_traces_are_present():
    assert len(TRACES) == 20, f"expected 20 conformance traces in {CONFORMANCE}"


@pytest.mark.parametrize("trace", TRACES, ids=lambda p: p.stem)
def test_replay_matches_vllm(trace: Path):
    expected = _lines(trace.with_suffix(".expected.jsonl"))
    with warnings.catch_warnings():
        # Some traces use budgets larger than max_num_seqs * max_model_len (a config warning).
        warnings.simplefilter("ignore", UserWarning)
        got = list(replay(json.loads(trace.read_text())))
    assert _normalized(got) == _normalized(expected)


def test_replay_cli_prints_the_expected_lines(tmp_path: Path):
    trace = CONFORMANCE / "c001.json"
    out = tmp_path / "out.jsonl"
    subprocess.run([sys.executable, "-m", "scheduler.replay", str(trace), "-o", str(out)],
                   check=True)
    expected = _lines(trace.with_suffix(".expected.jsonl"))
    assert _normalized(_lines(out)) == _normalized(expected)
    stdout = subprocess.run([sys.executable, "-m", "scheduler.replay", str(trace)], check=True,
                            capture_output=True, text=True).stdout
    assert stdout == out.read_text()
