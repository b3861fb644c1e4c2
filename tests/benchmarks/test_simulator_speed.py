"""benchmarks/simulator_speed.py: its workloads are docs/LAB.md's, and it reports every one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from jaxengine.lab.simulate import simulation_args, simulation_config

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "simulator_speed.py"


def _script():
    spec = importlib.util.spec_from_file_location("simulator_speed_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cost_model_is_smollm2_sized_and_holds_the_default_engine() -> None:
    cost = _script().smollm2_sized_cost()
    config = simulation_config(simulation_args(cost), cost).scheduler
    assert (cost.vocab_size, config.max_model_len, config.max_num_seqs) == (49152, 8192, 128)
    # 1 GiB of f32 KV at 30 layers x 3 KV heads x 64 x 2 (K and V) x 4 bytes a token.
    assert config.num_blocks == (1 << 30) // (46080 * 16)


def test_every_workload_is_simulated_and_reported(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    script = _script()
    monkeypatch.setattr(sys, "argv", ["simulator_speed.py", "--repeats", "1"])
    script.main()
    lines = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in lines]
    assert names == [*script.WORKLOADS, "mix64", "all"]
    steps = [int(line.split()[1]) for line in lines]
    assert all(n > 0 for n in steps) and steps[-1] == sum(steps[:-1])
    assert all(line.endswith("steps/s") for line in lines)
