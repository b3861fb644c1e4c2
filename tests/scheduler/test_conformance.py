"""Replay reproduces vLLM's recorded steps exactly on the twenty conformance traces, and says
so."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from scheduler import POLICIES
from scheduler.replay import first_difference, main, replay

CONFORMANCE = Path(__file__).resolve().parent / "conformance"
TRACES = sorted(CONFORMANCE.glob("c*[0-9].json"))


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_traces_are_present():
    assert len(TRACES) == 20, f"expected 20 conformance traces in {CONFORMANCE}"


@pytest.mark.parametrize("trace", TRACES, ids=lambda p: p.stem)
def test_replay_matches_vllm(trace: Path):
    expected = _lines(trace.with_suffix(".expected.jsonl"))
    with warnings.catch_warnings():
        # Some traces use budgets larger than max_num_seqs * max_model_len (a config warning).
        warnings.simplefilter("ignore", UserWarning)
        got = list(replay(json.loads(trace.read_text())))
    assert first_difference(got, expected) is None


def test_replay_cli_prints_the_expected_lines(tmp_path: Path):
    trace = CONFORMANCE / "c001.json"
    out = tmp_path / "out.jsonl"
    subprocess.run([sys.executable, "-m", "scheduler.replay", str(trace), "-o", str(out)],
                   check=True)
    expected = _lines(trace.with_suffix(".expected.jsonl"))
    assert first_difference(_lines(out), expected) is None
    stdout = subprocess.run([sys.executable, "-m", "scheduler.replay", str(trace)], check=True,
                            capture_output=True, text=True).stdout
    assert stdout == out.read_text()


def test_replay_prints_a_verdict_against_vllms_steps_beside_the_trace(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    trace = CONFORMANCE / "c001.json"
    expected = _lines(trace.with_suffix(".expected.jsonl"))
    assert main([str(trace), "-o", str(tmp_path / "out.jsonl")]) == 0
    assert f"matches vLLM's {len(expected)} steps" in capsys.readouterr().err
    # An altered copy of vLLM's steps: one step's free blocks, then one step fewer.
    copy = tmp_path / "c001.json"
    copy.write_text(trace.read_text())
    altered = [dict(r) for r in expected]
    altered[5]["num_free_blocks"] += 1
    copy.with_suffix(".expected.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in altered))
    assert main([str(copy), "-o", str(tmp_path / "out.jsonl")]) == 1
    err = capsys.readouterr().err
    assert (f"step 5: num_free_blocks {expected[5]['num_free_blocks']} here, "
            f"{expected[5]['num_free_blocks'] + 1} in vLLM") in err
    copy.with_suffix(".expected.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in expected[:-1]))
    assert main([str(copy), "-o", str(tmp_path / "out.jsonl")]) == 1
    assert f"vLLM took {len(expected) - 1} steps, the replay {len(expected)}" in (
        capsys.readouterr().err)
    copy.with_suffix(".expected.jsonl").unlink()  # nothing beside it: no verdict
    assert main([str(copy), "-o", str(tmp_path / "out.jsonl")]) == 0
    assert capsys.readouterr().err == ""


def test_replay_under_another_policy_gives_no_verdict(tmp_path: Path, monkeypatch,
                                                       capsys: pytest.CaptureFixture[str]):
    (tmp_path / "replay_policy.py").write_text(
        "from scheduler import SortedPolicy\n"
        "class Newest(SortedPolicy):\n    name = 'test-newest'\n"
        "    def sort_key(self, r): return (-r.arrival_time, r.request_id)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    trace = CONFORMANCE / "c001.json"
    try:
        assert main([str(trace), "-o", str(tmp_path / "out.jsonl"),
                     "--scheduling-policy", "replay_policy:Newest"]) == 0
        assert "no verdict: vLLM's steps" in capsys.readouterr().err
        assert first_difference(_lines(tmp_path / "out.jsonl"),
                                _lines(trace.with_suffix(".expected.jsonl"))) is not None
        assert main([str(trace), "-o", str(tmp_path / "out.jsonl"),
                     "--scheduling-policy", "fcfs"]) == 0  # the trace's own: a verdict
        assert "matches vLLM's" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            main([str(trace), "--scheduling-policy", "replay_policy:Nope"])
        assert "replay_policy.Nope is missing" in capsys.readouterr().err
    finally:
        POLICIES.pop("test-newest", None)
        sys.modules.pop("replay_policy", None)
