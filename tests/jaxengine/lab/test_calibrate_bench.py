"""Calibration, the real replay and the simulator against it, on the tiny test model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from jaxengine.engine.args import EngineArgs
from jaxengine.lab import trust
from jaxengine.lab.bench import bench
from jaxengine.lab.calibrate import Scene, calibrate
from jaxengine.lab.cost_model import CostModel
from jaxengine.lab.generators import scenario
from jaxengine.lab.results import summary
from jaxengine.lab.simulate import simulate, simulation_args
from jaxengine.runner.buckets import request_buckets, token_buckets
from scheduler import Request, SamplingParams, SchedulerConfig, add_request, init_state, schedule

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "tests" / "fixtures" / "tiny" / "llama_tied_mha")
ARGS = EngineArgs(model=TINY, max_num_batched_tokens=32, max_num_seqs=4, block_size=4,
                  max_model_len=128, num_gpu_blocks_override=80)
SCENES = [Scene(decodes=d, context=c, inject=(32, 48) if d < 4 else ())
          for d in (1, 2, 4) for c in (16, 64)]


@pytest.fixture(scope="module")
def cost() -> CostModel:
    return calibrate(ARGS, scenes=SCENES, repeats=2, log=lambda _: None)


def test_calibration_saves_what_it_was_calibrated_for(cost: CostModel) -> None:
    assert cost.engine_args["model"] == TINY and cost.backend == "cpu"
    # The backend as resolved (ARGS leave it to the platform), so that a file made when None
    # meant another kernel is not taken for this one's.
    assert ARGS.attention_backend is None and cost.engine_args["attention_backend"] == "cpu"
    assert cost.num_blocks == 80 and cost.max_model_len == 128
    assert cost.model_max_model_len == 256 and cost.vocab_size == 128
    assert cost.kv_bytes_per_token > 0 and cost.idle_call_seconds > 0
    assert cost.fit is not None and cost.fit.held_out_points > 0
    assert all(v >= 0 for v in cost.coefficients.values())
    # Every call costs host time: the smallest step (one request, one token) is priced above
    # zero. (Not `const` itself: with the bucket capped at 8 nearly constant on this tiny
    # model's buckets, the fit may put the fixed cost there.)
    s = init_state(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=128,
                                   num_blocks=80, block_size=4))
    s = add_request(s, Request(request_id="a", prompt_token_ids=(1,),
                               sampling_params=SamplingParams(max_tokens=2)))
    _, plan = schedule(s)
    assert cost.step_seconds(plan, token_buckets(32), request_buckets(4)) > 0
    assert simulation_args(cost) == dataclasses.replace(ARGS, precompile=None,
                                                        attention_backend="cpu")
    # Two passes over the grid: every scene was timed in each (samples keep the scene index).
    assert cost.info["repeats"] == 2
    assert len(cost.info["load_average"]) == 2 and min(cost.info["load_average"]) >= 0
    # The load after every scene of both passes, and the fit's warnings (none or one).
    assert len(cost.info["load_samples"]) == 2 * len(SCENES) and cost.info["cpu_count"] >= 1
    assert cost.info["warnings"] == trust.fit_warnings(cost)
    per_scene = [sum(1 for s in cost.info["samples"] if s[0] == i) for i in range(len(SCENES))]
    assert all(n >= 2 * SCENES[i].decode_steps for i, n in enumerate(per_scene))
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        calibrate(ARGS, scenes=SCENES, repeats=0)


def test_simulated_duration_is_near_the_real_replay(cost: CostModel) -> None:
    # All at t=0: the duration is the engine's own work, not the arrival process.
    w = scenario("srb_mix", num_requests=24, rate=float("inf"), seed=2, vocab_size=128,
                 scale=0.06)
    # The faster of two replays, each on a fresh warm engine (a second pass on one engine would
    # hit its prefix cache): other processes' pauses only add time, and a one-off pause of the
    # process (a garbage collection within the full suite) would outweigh the whole run.
    real = min((bench(w, ARGS) for _ in range(2)), key=lambda r: summary(r)["duration"])
    sim = simulate(w, cost, simulation_args(cost))
    assert [r.id for r in real.requests] == [r.id for r in sim.requests]
    assert [r.num_output_tokens for r in real.requests] == [r.max_tokens for r in w.requests]
    assert real.info["kind"] == "real" and len(real.steps) > 10
    assert len(real.info["load_average"]) == 2
    assert real.info["engine_args"]["attention_backend"] == "cpu"  # resolved, as calibrated
    assert {k: real.info[k] for k in ("backend", "device")} == {"backend": cost.backend,
                                                                "device": cost.device}
    # Generous: the 2-core machine is shared, and the tiny model's steps take about 1 ms of
    # host time, so scheduling noise of other processes is a large share of a step.
    ratio = summary(sim)["duration"] / summary(real)["duration"]
    assert 1 / 3 < ratio < 3, ratio
