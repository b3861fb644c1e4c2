"""The simulator: a real engine's loop call for call, times priced by the cost model."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.loops import AsyncLoop, SyncLoop
from jaxengine.lab.cost_model import FEATURES, CostModel
from jaxengine.lab.generators import scenario
from jaxengine.lab.simulate import Simulation, simulate, simulation_args, simulation_config
from jaxengine.lab.workloads import Workload, WorkloadRequest, parse_workload
from jaxengine.model.fake import fake_model
from scheduler import SamplingParams, schedule
from tests.engine_helpers import engine_over

V = 97
SMALL = dict(max_num_batched_tokens=32, max_num_seqs=4, block_size=4, max_model_len=112,
             num_gpu_blocks_override=40)


def cost_model(*, async_scheduling: bool = True, **coefficients: float) -> CostModel:
    """A hand-made cost model (seconds per unit of each feature) for the fake model."""
    coefs = {f: 0.0 for f in FEATURES} | coefficients
    idle = coefs.pop("idle", 0.0)
    args = EngineArgs(**SMALL, async_scheduling=async_scheduling)
    return CostModel(coefficients=coefs, idle_call_seconds=idle,
                     engine_args=dataclasses.asdict(args), backend="cpu",
                     device="cpu", num_blocks=40, kv_bytes_per_token=4, kv_budget_bytes=1 << 20,
                     max_model_len=112, model_max_model_len=256, vocab_size=V)


def workload(n: int = 12, seed: int = 0) -> Workload:
    """Mixed lengths and priorities, all at t=0: a pool of 40 blocks must preempt."""
    return scenario("srb_mix", num_requests=n, rate=float("inf"), seed=seed, vocab_size=V,
                    scale=0.08)


def engine_plans(w: Workload, args: EngineArgs, num_blocks: int) -> list[Any]:
    """Every plan a fake-model LLMEngine computes for `w` (all added before the first step)."""
    engine = engine_over(fake_model(V), args, tokenizer=None, max_model_len=args.max_model_len,
                         num_blocks=num_blocks)
    for r in w.requests:
        engine.add_request(r.request_id, list(r.prompt_token_ids),
                           SamplingParams(max_tokens=r.max_tokens, temperature=0.0,
                                          ignore_eos=True), arrival_time=0.0,
                           priority=r.priority)
    plans = []
    while engine.has_unfinished_requests():
        plans.append(schedule(engine.snapshot())[1])  # the scheduler is pure: the same plan
        engine.step()
    return plans


def summary_of(plan: Any) -> tuple:
    return (tuple(plan.num_scheduled_tokens.items()), tuple(sorted(plan.preempted_req_ids)),
            plan.sampling_req_ids)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_simulator_schedules_exactly_what_the_engine_schedules(
        async_scheduling: bool, policy: str) -> None:
    args = EngineArgs(**SMALL, async_scheduling=async_scheduling, scheduling_policy=policy)
    cost = cost_model(const=1e-3, async_scheduling=async_scheduling)
    w = workload()
    sim = Simulation(w, cost, args, keep_plans=True)
    result = sim.run()
    expected = engine_plans(w, args, num_blocks=40)
    assert [summary_of(p) for p in sim.plans] == [summary_of(p) for p in expected]
    # The pool is small enough to hold requests back (reserve_full_prompt admits a request
    # only when its whole sequence fits, so the engine does not preempt here).
    assert max(s["num_waiting"] for s in result.steps) > 0
    assert max(s["kv_cache_usage"] for s in result.steps) > 0.8
    assert all(r.num_output_tokens == q.max_tokens
               for r, q in zip(result.requests, w.requests, strict=True))


class Lifecycle:
    """A stat logger: per engine step, (prompt tokens, generation tokens, the finished requests
    with their reasons and token counts): the requests' lifecycle as the engine reports it."""

    def __init__(self) -> None:
        self.steps: list[tuple] = []

    def record(self, scheduler_stats: Any, stats: Any) -> None:
        finished = sorted((f.finish_reason, f.num_prompt_tokens, f.num_generation_tokens)
                          for f in stats.finished_requests)
        self.steps.append((stats.num_prompt_tokens, stats.num_generation_tokens, finished))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_simulation_steps_the_engines_own_loop(async_scheduling: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every simulated call is one call of the engine's loop (`jaxengine.engine.loops`), and the
    requests' lifecycle the engine's stat loggers see is that of a fake-model engine running the
    same requests on a real runner."""
    loop = AsyncLoop if async_scheduling else SyncLoop
    calls = []
    real_step = loop.step

    def counted(self: Any, *a: Any) -> Any:
        calls.append(self.engine)
        return real_step(self, *a)

    monkeypatch.setattr(loop, "step", counted)
    args = EngineArgs(**SMALL, async_scheduling=async_scheduling)
    w = workload()
    sim = Simulation(w, cost_model(const=1e-3, async_scheduling=async_scheduling), args)
    simulated = Lifecycle()
    sim.engine.stat_loggers.append(simulated)
    result = sim.run()
    assert len(calls) == len(result.steps) and set(calls) == {sim.engine}

    engine = engine_over(fake_model(V), args, tokenizer=None, max_model_len=args.max_model_len,
                         num_blocks=40)
    real = Lifecycle()
    engine.stat_loggers.append(real)
    for r in w.requests:
        engine.add_request(r.request_id, list(r.prompt_token_ids),
                           SamplingParams(max_tokens=r.max_tokens, temperature=0.0,
                                          ignore_eos=True), arrival_time=0.0,
                           priority=r.priority)
    while engine.has_unfinished_requests():
        engine.step()
    assert simulated.steps == real.steps
    assert sum(len(f) for *_, f in real.steps) == len(w.requests)


def test_what_the_cost_model_cannot_price_is_refused() -> None:
    cost = cost_model()
    for name, value in (("speculative_config", {"method": "ngram",
                                                "num_speculative_tokens": 2}),
                        ("kv_offloading_size", 0.001)):
        args = simulation_args(cost, {name: value})
        with pytest.raises(ValueError, match=f"does not price {name}"):
            simulate(workload(), cost, args)


def test_config_matches_the_engines() -> None:
    cost = cost_model()
    for extra in ({}, {"enable_chunked_prefill": False, "max_num_batched_tokens": 112},
                  {"max_num_partial_prefills": 2, "long_prefill_token_threshold": 8}):
        args = EngineArgs(**(SMALL | extra))
        engine = engine_over(fake_model(V), args, tokenizer=None, max_model_len=112,
                             num_blocks=40)
        assert simulation_config(args, cost).scheduler == engine.scheduler_config


def test_pool_is_sized_from_the_calibrated_budget() -> None:
    cost = cost_model()
    args = dataclasses.replace(EngineArgs(**SMALL), num_gpu_blocks_override=None)
    assert simulation_config(args, cost).scheduler.num_blocks == (1 << 20) // (4 * 4)
    with pytest.raises(ValueError, match="num_gpu_blocks_override=5 leaves 4 usable KV blocks"):
        simulation_config(dataclasses.replace(args, num_gpu_blocks_override=5), cost)


def one_request(arrival: float) -> Workload:
    return Workload(requests=(WorkloadRequest(request_id="a", prompt_token_ids=(1,) * 10,
                                              max_tokens=3, arrival_time=arrival),))


def test_times_of_one_request_by_hand_synchronous() -> None:
    cost = cost_model(const=0.1, async_scheduling=False)
    r = simulate(one_request(5.0), cost)
    (a,) = r.requests
    # Calls at 5.0 (prefill: token 1 at 5.1), 5.1 (token 2 at 5.2), 5.2 (token 3, done, 5.3).
    assert a.queue == 0.0
    assert a.ttft == pytest.approx(0.1) and a.tpot == pytest.approx(0.1)
    assert a.e2e == pytest.approx(0.3) and r.duration == pytest.approx(5.3)
    assert [s["seconds"] for s in r.steps] == pytest.approx([0.1] * 3)


def test_times_of_one_request_by_hand_async() -> None:
    cost = cost_model(const=0.1, idle=0.05)
    r = simulate(one_request(2.0), cost)
    (a,) = r.requests
    # Call 1 dispatches the prefill (idle: 0.05); calls 2-4 complete one plan each (0.1).
    assert a.ttft == pytest.approx(0.15) and a.e2e == pytest.approx(0.35)
    assert r.duration == pytest.approx(2.35)
    assert [s["seconds"] for s in r.steps] == pytest.approx([0.05, 0.1, 0.1, 0.1])


def test_arrivals_wait_for_the_clock_and_costs_follow_the_features() -> None:
    w = parse_workload([{"id": "late", "prompt_token_ids": [3] * 8, "max_tokens": 2,
                         "arrival_time": 1.0},
                        {"id": "early", "prompt_token_ids": [2] * 8, "max_tokens": 2}])
    cost = cost_model(padded_tokens=0.01, async_scheduling=False)
    r = simulate(w, cost)
    late, early = r.requests
    assert (late.id, early.id) == ("late", "early")  # workload order
    assert early.ttft == pytest.approx(0.08)  # the 8-token prefill runs in bucket 8
    assert early.e2e == pytest.approx(0.09)  # then one decode in bucket 1
    assert late.queue == 0.0 and late.e2e == pytest.approx(0.09)
    assert r.duration == pytest.approx(1.09)


def test_sampler_rows_are_priced_in_the_request_bucket_of_the_simulated_engine() -> None:
    w = parse_workload([{"prompt_token_ids": [2] * 8, "max_tokens": 2}])
    cost = cost_model(sampler_rows=0.01, async_scheduling=False)
    # max_num_seqs=4: one request bucket of 4 rows; the prefill and the decode both sample.
    assert simulate(w, cost).duration == pytest.approx(0.08)
    # max_num_seqs=16: buckets 8 and 16, one sampler pads to 8 rows.
    wider = simulation_args(cost, {"max_num_seqs": 16})
    assert simulate(w, cost, wider).duration == pytest.approx(0.16)


def test_the_scheduled_budget_caps_each_step_and_the_runners_buckets_price_it() -> None:
    w = parse_workload([{"prompt_token_ids": [2] * 24, "max_tokens": 1}])
    cost = cost_model(padded_tokens=0.01, async_scheduling=False)
    # max_num_batched_tokens=32 (buckets 1..16, 32): the prompt in one step, in bucket 32
    assert simulate(w, cost).duration == pytest.approx(0.32)
    # 12 tokens a step: two steps, each padded to the runner's bucket of 16
    capped = simulate(w, cost, simulation_args(cost, {"max_num_scheduled_tokens": 12}))
    assert [s["prefill_tokens"] for s in capped.steps] == [12, 12]
    assert capped.duration == pytest.approx(0.32)
    # The same two steps in a runner sized for 12 (buckets 1..8, 12) cost less
    small = simulate(w, cost, simulation_args(cost, {"max_num_batched_tokens": 12}))
    assert small.duration == pytest.approx(0.24)


def test_requests_the_engine_would_refuse_are_refused() -> None:
    cost = cost_model()
    too_long = parse_workload([{"prompt_token_ids": [1] * 100, "max_tokens": 20}])
    with pytest.raises(ValueError, match="exceeds max_model_len=112"):
        simulate(too_long, cost)
    beyond = parse_workload([{"prompt_token_ids": [1, V], "max_tokens": 2}])
    with pytest.raises(ValueError, match=f"vocabulary of {V}"):
        simulate(beyond, cost)


def test_simulation_args_keep_the_calibration_and_refuse_another_model() -> None:
    cost = cost_model()
    args = simulation_args(cost, {"max_num_seqs": 2})
    assert (args.max_num_seqs, args.block_size) == (2, 4)
    with pytest.raises(ValueError, match="calibrated with model=None"):
        simulation_args(cost, {"model": "other.gguf"})
    with pytest.raises(ValueError, match="async_scheduling=True, not False"):
        simulation_args(cost, {"async_scheduling": False})


def test_the_simulator_is_fast() -> None:
    import time

    w = scenario("srb_mix", num_requests=200, rate=50.0, seed=1, vocab_size=V, scale=0.08)
    cost = cost_model(const=1e-3, padded_tokens=1e-5)
    args = simulation_args(cost, {"max_num_batched_tokens": 64, "max_num_seqs": 16,
                                  "num_gpu_blocks_override": 400})
    t0 = time.perf_counter()
    r = simulate(w, cost, args)
    seconds = time.perf_counter() - t0
    assert len(r.steps) > 500
    assert len(r.steps) / seconds > 1000  # steps per second
    assert np.isfinite(r.duration)
