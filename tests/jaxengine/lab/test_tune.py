"""The tuner: SLO parsing, the sweep, the Pareto set and the recommendation."""

from __future__ import annotations

import dataclasses

import pytest

from jaxengine.engine.args import EngineArgs
from jaxengine.lab.cost_model import FEATURES, CostModel
from jaxengine.lab.generators import scenario
from jaxengine.lab.simulate import simulation_args
from jaxengine.lab.tune import format_report, parse_slo, tune

SIZES = {"max_num_seqs": (2, 8), "max_num_batched_tokens": (16, 64)}


def cost() -> CostModel:
    args = EngineArgs(max_num_batched_tokens=64, max_num_seqs=8, block_size=4,
                      max_model_len=128, num_gpu_blocks_override=200)
    return CostModel(
        coefficients={f: 0.0 for f in FEATURES} | {"const": 0.01, "padded_tokens": 1e-3},
        idle_call_seconds=0.005, engine_args=dataclasses.asdict(args), backend="cpu",
        device="cpu", num_blocks=200, kv_bytes_per_token=64, kv_budget_bytes=1 << 20,
        max_model_len=128, model_max_model_len=256, vocab_size=128)


def test_parse_slo() -> None:
    assert parse_slo("ttft_p99=2, tpot_p50=0.1") == {"ttft_p99": 2.0, "tpot_p50": 0.1}
    assert parse_slo("") == {}
    for bad, needle in (("ttft=1", "unknown SLO metric"), ("ttft_p99=x", "number of seconds"),
                        ("e2e_p90=0", "must be > 0")):
        with pytest.raises(ValueError, match=needle):
            parse_slo(bad)


def test_the_recommendation_meets_the_slo_and_tops_throughput() -> None:
    c = cost()
    w = scenario("srb_mix", num_requests=30, rate=float("inf"), seed=0, vocab_size=128,
                 scale=0.06)
    loose = tune(w, c, simulation_args(c), slo={"ttft_p99": 100.0}, sizes=SIZES)
    assert all(t.meets_slo for t in loose.trials) and loose.recommended == 0
    best = loose.trials[0]
    assert best.summary["output_tokens_per_s"] == max(
        t.summary["output_tokens_per_s"] for t in loose.trials)
    assert {"s2/b16/t0/p1/fcfs", "s8/b64/t0/p1/fcfs"} <= {t.label for t in loose.trials}
    assert any(not t.settings["enable_chunked_prefill"] for t in loose.trials)
    assert any(t.settings["scheduling_policy"] == "priority" for t in loose.trials)
    assert loose.recommended in loose.pareto
    text = format_report(loose)
    assert f"recommended engine flags: --max-num-seqs {best.settings['max_num_seqs']}" in text
    # Half the best TTFT p99: only some configurations (or none) can meet it.
    limit = min(t.summary["ttft_p99"] for t in loose.trials) * 0.5
    strict = tune(w, c, simulation_args(c), slo={"ttft_p99": limit}, sizes=SIZES)
    assert strict.recommended is None and not strict.pareto
    assert "no configuration meets the SLO; the closest is" in format_report(strict)
