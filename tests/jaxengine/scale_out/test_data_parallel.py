"""Data parallelism over fake-model replicas (no devices needed): routing, ids, aborts, seeds.

The replicas here share jax's one CPU device; `test_data_parallel_devices.py` puts them on
distinct virtual devices with a real checkpoint.
"""

from __future__ import annotations

import jax
import pytest

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.llm import LLM
from jaxengine.model.fake import fake_greedy
from jaxengine.replicas.data_parallel import (
    DataParallelEngine,
    build_engines,
    device_groups,
)
from jaxengine.replicas.router import Route, route
from scheduler import Request, SamplingParams, SchedulerConfig, add_request, init_state, schedule
from tests.jaxengine.engine.test_llm_engine import PROMPTS, V, make_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SHARED = list(range(50, 82))  # 32 tokens: 8 blocks of make_engine's block_size 4


def _dp(n: int = 2, **kw) -> DataParallelEngine:  # type: ignore[no-untyped-def]
    return DataParallelEngine([make_engine(**kw) for _ in range(n)])


def _ids(prompt: list[int]) -> dict[str, list[int]]:
    return {"prompt_token_ids": prompt}


def _finish(engine: LLMEngine | DataParallelEngine) -> dict[str, list[int]]:
    done = {}
    for _ in range(500):  # bounded: far more steps than any workload here needs
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert not engine.has_unfinished_requests()
    return done


def test_a_shared_prefix_goes_to_the_replica_that_cached_it() -> None:
    dp = _dp()
    assert dp.add_request("a", _ids(SHARED + [1, 2]), LONG) == Route(replica=0, hit_tokens=0,
                                                                     load=0)
    dp.step()  # a's first 32 tokens are scheduled: its 8 full blocks are cached on replica 0
    assert dp.add_request("c", _ids([7, 8, 9]), LONG) == Route(replica=1, hit_tokens=0, load=0)
    assert dp.add_request("d", _ids([4, 5]), LONG) == Route(replica=0, hit_tokens=0, load=1)
    # Replica 0 is the busier one (a, d against c), but only it holds the prefix.
    assert dp.add_request("b", _ids(SHARED + [3, 4]), LONG) == Route(replica=0, hit_tokens=32,
                                                                     load=2)
    assert [dp.replica_of(r) for r in "abcd"] == [0, 0, 1, 0]
    # A prompt-logprobs request reads no prefix cache (skip_reading_prefix_cache): by load.
    scored = SamplingParams(max_tokens=2, prompt_logprobs=1)
    assert dp.add_request("e", _ids(SHARED + [5, 6]), scored) == Route(replica=1, hit_tokens=0,
                                                                       load=1)
    done = _finish(dp)
    assert done["b"] == fake_greedy(SHARED + [3, 4], 40, V)
    assert done["e"] == fake_greedy(SHARED + [5, 6], 2, V)
    assert done["a"] == fake_greedy(SHARED + [1, 2], 40, V)
    assert dp.replicas[0].snapshot().counters.prefix_cache_hits == 32
    assert dp.replicas[1].snapshot().counters.prefix_cache_hits == 0
    assert dp.replica_of("a") is None  # finished requests are forgotten


def _state(*prompts: tuple[int, ...], scheduled: bool):  # type: ignore[no-untyped-def]
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64,
                          block_size=4, num_blocks=40)
    s = init_state(cfg)
    for i, p in enumerate(prompts):
        s = add_request(s, Request(request_id=f"r{i}", prompt_token_ids=p,
                                   sampling_params=SamplingParams(max_tokens=4)))
    return schedule(s)[0] if scheduled else s


def test_route_prefers_the_hit_then_the_load_then_the_lowest_index() -> None:
    p = tuple(range(1, 14))  # 13 tokens: 3 blocks may hit
    q = Request(request_id="q", prompt_token_ids=p[:12] + (99,))
    fresh = Request(request_id="f", prompt_token_ids=(7, 7, 7))
    empty, cached = _state(scheduled=False), _state(p, scheduled=True)
    busy_cached = _state(p, (5, 5), scheduled=True)
    assert route([empty, cached], q) == Route(replica=1, hit_tokens=12, load=1)
    assert route([busy_cached, cached], q) == Route(replica=1, hit_tokens=12, load=1)
    assert route([cached, busy_cached], q).replica == 0
    assert route([cached, cached], q).replica == 0  # a full tie: the lowest index
    assert route([busy_cached, empty, cached], fresh) == Route(replica=1, hit_tokens=0, load=0)
    assert route([_state(p, scheduled=False), empty], q).replica == 1  # not cached until run
    with pytest.raises(ValueError, match="at least one replica"):
        route([], q)


def test_outputs_equal_one_engines_greedy_and_sampled() -> None:
    sampled = SamplingParams(max_tokens=8, temperature=5.0, ignore_eos=True)  # seed-dependent
    seeded = SamplingParams(max_tokens=8, temperature=5.0, ignore_eos=True, seed=123)
    for params in (GREEDY, sampled, [seeded, sampled] * 3 + [sampled]):
        single = LLM.from_engine(make_engine()).generate(PROMPTS, params, use_tqdm=False)
        dp = _dp()
        double = LLM.from_engine(dp).generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in double] == [
            o.outputs[0].token_ids for o in single]
        assert all(r.snapshot().counters.prefix_cache_queries > 0 for r in dp.replicas)
    single_out = [o.outputs[0].token_ids for o in single]
    assert single_out[1] != fake_greedy(PROMPTS[1], 8, V)  # the sampling is really random


def test_a_refused_request_changes_nothing_not_even_the_seeds() -> None:
    sampled = SamplingParams(max_tokens=8, temperature=5.0, ignore_eos=True)
    results = []
    for engine in (make_engine(), _dp()):
        engine.add_request("x", _ids(PROMPTS[0]), sampled)
        with pytest.raises(ValueError, match="prompt_token_ids must be ints"):
            engine.add_request("bad", _ids([V]), sampled)  # V is outside the vocabulary
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("x", _ids(PROMPTS[1]), sampled)
        with pytest.raises(ValueError, match="leaves no room for output"):  # the replica's no
            engine.add_request("long", _ids([1] * 256), sampled)  # max_model_len is 256
        with pytest.raises(ValueError, match="logprobs"):
            engine.add_request("lp", _ids([1]), SamplingParams(logprobs=21))
        engine.add_request("y", _ids(PROMPTS[1]), sampled)
        assert engine.get_num_unfinished_requests() == 2
        results.append(_finish(engine))
    assert results[0] == results[1]


def test_ids_are_unique_across_replicas_and_reusable_once_finished() -> None:
    dp = _dp()
    dp.add_request("a", _ids(PROMPTS[0]), GREEDY)
    dp.add_request("b", _ids(PROMPTS[1]), GREEDY)  # replica 1
    with pytest.raises(ValueError, match="'a': this id is already in use"):
        dp.add_request("a", _ids(PROMPTS[2]), GREEDY)  # would go to replica 1 by load
    assert [r.get_num_unfinished_requests() for r in dp.replicas] == [1, 1]
    assert _finish(dp) == {"a": fake_greedy(PROMPTS[0], 6, V), "b": fake_greedy(PROMPTS[1], 6, V)}
    assert dp.add_request("a", _ids(PROMPTS[2]), GREEDY).replica == 0


def test_an_abort_goes_to_the_replica_that_owns_the_request() -> None:
    dp = _dp()
    for rid, prompt in zip("abc", PROMPTS, strict=False):
        dp.add_request(rid, _ids(prompt), LONG)  # a, c on replica 0; b on replica 1
    dp.step()
    outputs = dp.abort_request(["b", "unknown", "b"])
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outputs] == [("b", "abort")]
    assert [r.get_num_unfinished_requests() for r in dp.replicas] == [2, 0]
    r1 = dp.replicas[1].snapshot()
    assert r1.num_free_blocks == r1.config.num_blocks - 1  # b's blocks are free
    assert dp.abort_request("b") == [] and dp.replica_of("b") is None
    assert [o.request_id for o in dp.abort_request(("c", "a"))] == ["c", "a"]
    assert not dp.has_unfinished_requests() and dp.step() == []


def test_a_step_steps_only_the_replicas_with_work() -> None:
    dp = _dp()
    dp.add_request("a", _ids(PROMPTS[0]), GREEDY)
    dp.step()
    assert [r.snapshot().step for r in dp.replicas] == [1, 0]


def test_device_groups_and_their_errors() -> None:
    assert device_groups(1, 1) == [jax.devices()[:1]]
    with pytest.raises(ValueError, match=r"data_parallel_size=2 x tensor_parallel_size=1 "
                                         r"needs 2 devices, but jax sees 1"):
        device_groups(2, 1)
    with pytest.raises(ValueError, match="needs 4 devices, but 2 were given"):
        device_groups(2, 2, ["d0", "d1"])  # type: ignore[list-item]
    assert device_groups(2, 2, list("abcd")) == [["a", "b"], ["c", "d"]]  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs 2 devices"):  # before any model is loaded
        build_engines(EngineArgs(model="/nonexistent", data_parallel_size=2))


def test_data_parallel_over_several_processes_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="data_parallel_size=2 with 2 processes is not "
                                         "supported"):
        build_engines(EngineArgs(model="/nonexistent", data_parallel_size=2))


def test_engine_args_validate_data_parallel_size() -> None:
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1, got 0"):
        EngineArgs(data_parallel_size=0)
    assert EngineArgs().data_parallel_size == 1


def test_replicas_of_an_engine_and_of_a_data_parallel_one() -> None:
    single = make_engine()
    dp = _dp(3)
    assert single.replicas == (single,)
    assert len(dp.replicas) == 3
    with pytest.raises(ValueError, match="at least one replica"):
        DataParallelEngine([])
