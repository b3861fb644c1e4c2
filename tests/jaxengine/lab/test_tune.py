"""The tuner: SLO parsing, the sweep, the Pareto set and the recommendation."""

from __future__ import annotations

import dataclasses

import pytest

from jaxengine.engine.args import EngineArgs
from jaxengine.lab.cost_model import FEATURES, CostModel
from jaxengine.lab.generators import scenario
from jaxengine.lab.simulate import simulation_args
from jaxengine.lab.tune import NUM_CLOSEST, format_report, parse_slo, plot_data, tune
from scheduler import POLICIES

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
    # A scheduled budget of three quarters of the budget, in the budget's runner
    capped = [t for t in loose.trials if t.settings["max_num_scheduled_tokens"] is not None]
    assert capped and all(t.settings["max_num_scheduled_tokens"]
                          == t.settings["max_num_batched_tokens"] * 3 // 4 for t in capped)
    b = capped[0].settings["max_num_batched_tokens"]
    assert f"/b{b}/n{b * 3 // 4}/" in capped[0].label
    assert f"--max-num-scheduled-tokens {b * 3 // 4}" in capped[0].flags()
    plain = next(t for t in loose.trials if t.settings["max_num_scheduled_tokens"] is None)
    assert "--max-num-scheduled-tokens" not in plain.flags() and "None" not in plain.flags()
    # Every registered policy is swept (research ones too), or those it is given.
    assert {t.settings["scheduling_policy"] for t in loose.trials} == set(POLICIES)
    assert loose.recommended in loose.pareto
    text = format_report(loose)
    assert f"recommended engine flags: --max-num-seqs {best.settings['max_num_seqs']}" in text
    # Half the best TTFT p99: only some configurations (or none) can meet it.
    limit = min(t.summary["ttft_p99"] for t in loose.trials) * 0.5
    strict = tune(w, c, simulation_args(c), slo={"ttft_p99": limit}, sizes=SIZES)
    assert strict.recommended is None and not strict.pareto
    assert "no configuration meets the SLO; the closest is" in format_report(strict)


def _rows(text: str) -> list[str]:
    """The configurations a report's text lists (its table rows), in order."""
    return [line.split()[0] for line in text.splitlines()
            if line.startswith("  ") and line.split()[0].startswith("s")
            and "/" in line.split()[0]]


def _outcome(t) -> tuple[float, float]:
    """Throughput and the SLO's one metric (both reports' SLOs are on ttft_p99)."""
    return (round(t.summary["output_tokens_per_s"], 6), round(t.summary["ttft_p99"], 9))


def test_listed_configurations_are_distinct_and_the_plot_draws_what_the_text_lists() -> None:
    c = cost()
    w = scenario("srb_mix", num_requests=12, rate=float("inf"), seed=0, vocab_size=128,
                 scale=0.06)
    given = tune(w, c, simulation_args(c), slo={"ttft_p99": 100.0}, sizes=SIZES,
                 policies=["fcfs", "las"])
    assert {t.settings["scheduling_policy"] for t in given.trials} == {"fcfs", "las"}
    with pytest.raises(ValueError, match="registered scheduling policies; got .*'lifo'"):
        tune(w, c, simulation_args(c), slo={}, sizes=SIZES, policies=["lifo"])
    # A limit no configuration meets: the closest, each outcome once.
    strict = tune(w, c, simulation_args(c), slo={"ttft_p99": 1e-6}, sizes=SIZES)
    for report in (given, strict):
        text = format_report(report)
        listed = [report.trials[i] for i in report.listed]
        assert _rows(text) == [t.label for t in listed]
        outcomes = [_outcome(t) for t in listed]
        assert len(set(outcomes)) == len(outcomes)
        # The others with the same outcome as a listed one are counted, never listed.
        for i in report.listed:
            same = [t for t in report.trials if _outcome(t) == _outcome(report.trials[i])]
            assert report.alike[i] == len(same) - 1
        data = plot_data(report)
        assert data["front"] == [report.trials[i].label for i in report.pareto]
        assert sorted([*data["annotate"], *filter(None, [data["recommended"]])]) == sorted(
            _rows(text))
        assert len(data["points"]) == len(report.trials)
    assert strict.recommended is None and not strict.pareto
    assert len(strict.closest) == min(NUM_CLOSEST, len({_outcome(t) for t in strict.trials}))
    assert plot_data(strict)["front"] == [] and "the closest 5" in format_report(strict)
