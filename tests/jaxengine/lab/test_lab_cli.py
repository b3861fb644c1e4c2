"""The lab's subcommands: workload, simulate, tune, calibrate, bench --workload."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

import scheduler
from jaxengine.cli import main
from jaxengine.engine.args import EngineArgs
from jaxengine.lab.cost_model import FEATURES, CostModel, load_cost_model, save_cost_model
from jaxengine.lab.results import load_result

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "tests" / "fixtures" / "tiny" / "llama_tied_mha")
SMALL = ["--max-num-batched-tokens", "32", "--max-num-seqs", "4", "--block-size", "4",
         "--max-model-len", "128", "--num-gpu-blocks-override", "80"]


def hand_made_cost(path: Path) -> Path:
    """A cost model file with made-up coefficients (no engine is built)."""
    args = EngineArgs(max_num_batched_tokens=64, max_num_seqs=8, block_size=4,
                      max_model_len=128, num_gpu_blocks_override=100)
    save_cost_model(CostModel(
        coefficients={f: 0.0 for f in FEATURES} | {"const": 1e-3, "padded_tokens": 1e-4},
        idle_call_seconds=5e-4, engine_args=dataclasses.asdict(args), backend="cpu",
        device="cpu", num_blocks=100, kv_bytes_per_token=64, kv_budget_bytes=1 << 20,
        max_model_len=128, model_max_model_len=256, vocab_size=128), path)
    return path


def test_workload_simulate_and_tune(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    w, cost, out = tmp_path / "w.json", hand_made_cost(tmp_path / "c.json"), tmp_path / "o.json"
    assert main(["workload", "srb_mix", "--output", str(w), "--num-requests", "30",
                 "--rate", "50", "--scale", "0.06", "--vocab-size", "128"]) == 0
    assert main(["simulate", str(w), "--cost-model", str(cost), "--output", str(out),
                 "--plot", str(tmp_path / "t.png"), "--max-num-seqs", "2"]) == 0
    printed = capsys.readouterr().out
    assert "simulated: 30 requests" in printed and (tmp_path / "t.png").stat().st_size > 1000
    result = load_result(out)
    assert result.info["kind"] == "simulated" and len(result.requests) == 30
    assert result.info["engine_args"]["max_num_seqs"] == 2  # the flag over the cost model's
    assert max(s["num_running"] for s in result.steps) == 2
    assert main(["simulate", str(w), "--cost-model", str(cost), "--compare", str(out),
                 "--max-num-seqs", "2"]) == 0
    assert "simulated / real - 1: duration +0.0%, ttft_p50 +0.0%" in capsys.readouterr().out
    assert main(["tune", str(w), "--cost-model", str(cost), "--slo", "ttft_p99=10",
                 "--output", str(tmp_path / "tune.json"), "--plot",
                 str(tmp_path / "p.png")]) == 0
    printed = capsys.readouterr().out
    assert "Pareto front" in printed and "recommended engine flags: --max-num-seqs" in printed
    report = json.loads((tmp_path / "tune.json").read_text())
    assert report["recommended"] is not None and len(report["trials"]) > 20


def test_lab_commands_report_bad_input(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    cost = hand_made_cost(tmp_path / "c.json")
    w = tmp_path / "w.json"
    w.write_text(json.dumps({"requests": [{"prompt_token_ids": [1], "max_tokens": 0}]}))
    assert main(["simulate", str(w), "--cost-model", str(cost)]) == 1
    assert "requests[0].max_tokens must be an integer >= 1" in capsys.readouterr().err
    w.write_text(json.dumps({"requests": [{"prompt_token_ids": [1], "max_tokens": 2}]}))
    assert main(["tune", str(w), "--cost-model", str(cost), "--slo", "ttft_p42=1"]) == 1
    assert "unknown SLO metric 'ttft_p42'" in capsys.readouterr().err
    assert main(["simulate", str(w), "--cost-model", str(tmp_path / "none.json")]) == 1
    assert "jaxengine calibrate" in capsys.readouterr().err
    assert main(["simulate", str(w), "--cost-model", str(cost), "--model", "x.gguf"]) == 1
    assert "calibrated with model=None" in capsys.readouterr().err


def test_calibrate_then_bench_a_workload_on_the_tiny_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cost, w, out = tmp_path / "c.json", tmp_path / "w.json", tmp_path / "real.json"
    assert main(["calibrate", "--output", str(cost), "--model", TINY, *SMALL]) == 0
    printed = capsys.readouterr().out
    assert "held-out error over" in printed and load_cost_model(cost).num_blocks == 80
    assert main(["workload", "many_short", "--output", str(w), "--num-requests", "8",
                 "--rate", "100", "--scale", "0.3", "--vocab-size", "128"]) == 0
    assert main(["bench", "--workload", str(w), "--output", str(out), "--model", TINY,
                 *SMALL]) == 0
    real = load_result(out)
    assert real.info["kind"] == "real" and len(real.requests) == 8
    assert all(r.ttft is not None and r.ttft > 0 for r in real.requests)
    assert real.duration >= max(r.arrival_time for r in real.requests)


POLICY_MODULE = """
from scheduler import SortedPolicy


class LongestFirst(SortedPolicy):
    name = "test-cli-longest"

    def sort_key(self, r):
        return (-r.num_prompt_tokens, r.arrival_time, r.request_id)
"""


def test_a_policy_from_a_module_in_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "lab_cli_policy.py").write_text(POLICY_MODULE)
    (tmp_path / "w.json").write_text(json.dumps({"requests": [
        {"prompt_token_ids": [1] * n, "max_tokens": 2} for n in (3, 9, 5)]}))
    monkeypatch.chdir(tmp_path)  # the module is found there, as `jaxengine` run from it would
    monkeypatch.setattr("sys.path", [p for p in sys.path if p not in ("", str(tmp_path))])
    cost = hand_made_cost(tmp_path / "c.json")
    try:
        assert main(["simulate", "w.json", "--cost-model", str(cost), "--max-num-seqs", "1",
                     "--scheduling-policy", "lab_cli_policy:LongestFirst",
                     "--output", "o.json"]) == 0
        result = load_result(tmp_path / "o.json")
        assert result.info["engine_args"]["scheduling_policy"] == "test-cli-longest"
        # One at a time, longest prompt first: r1 (9), r2 (5), r0 (3).
        order = sorted(result.requests, key=lambda r: r.ttft)
        assert [r.id for r in order] == ["r1", "r2", "r0"]
        assert main(["tune", "w.json", "--cost-model", str(cost), "--policies",
                     "fcfs, lab_cli_policy:LongestFirst", "--output", "t.json"]) == 0
        trials = json.loads((tmp_path / "t.json").read_text())["trials"]
        assert {t["settings"]["scheduling_policy"] for t in trials} == {"fcfs",
                                                                        "test-cli-longest"}
    finally:
        scheduler.POLICIES.pop("test-cli-longest", None)
        sys.modules.pop("lab_cli_policy", None)
    capsys.readouterr()
    assert main(["tune", "w.json", "--cost-model", str(cost), "--policies", "fcfs,lifo"]) == 1
    assert "unknown scheduling policy 'lifo'" in capsys.readouterr().err
    for spec, needle in (("lab_cli_nothing:X", "module 'lab_cli_nothing' does not import"),
                         ("json:dumps", "json.dumps is a function, not a subclass")):
        with pytest.raises(SystemExit):
            main(["simulate", "w.json", "--cost-model", str(cost), "--scheduling-policy", spec])
        assert needle in capsys.readouterr().err
