"""Host offloading in the engine loop, over the fake model (whose next token is a function of
the KV it reads back through the block table, so a wrong or missing load changes the output).

The workload: requests sharing a 32-token prefix, with unrelated 60-token requests between
them, one at a time in a pool of 23 usable blocks of 4 tokens. The unrelated requests evict the
shared prefix from the device's prefix cache; with offloading its blocks go to the host store
on eviction and come back for the next request that shares it.
"""

from __future__ import annotations

from typing import Any

import pytest

from jaxengine.cli import build_parser, engine_args_from
from jaxengine.engine.args import EngineArgs
from jaxengine.kv_offload import OffloadingConnector, OffloadingWorker
from jaxengine.metrics import LoggingStatLogger, PrometheusStatLogger
from jaxengine.model.fake import fake_greedy
from scheduler import KVConnectorOutput, RequestStatus, SamplingParams, check_invariants
from scheduler.kv.hashing import extend_block_hashes
from tests.jaxengine.engine.test_llm_engine import GREEDY, V, make_engine
from tests.jaxengine.engine.test_llm_engine import PROMPTS as ENGINE_PROMPTS

SHARED = list(range(1, 33))  # 8 blocks


def other(k: int) -> list[int]:
    return [(k * 7 + j) % 90 + 1 for j in range(60)]


PROMPTS = [SHARED + [40, 41], other(1), other(2), SHARED + [50, 51], other(3), SHARED + [60]]
GiB = 2**30


def offload_engine(size: float | None = 0.001, **kw: Any):
    base: dict[str, Any] = dict(num_blocks=24, max_num_seqs=1, kv_offloading_size=size)
    base.update(kw)
    return make_engine(**base)


def run(engine, prompts=PROMPTS, params=GREEDY, *, aborts=None) -> dict[str, list[int]]:
    """Every prompt to the end (aborting `aborts[step]` before that step), invariants checked;
    token ids of each request that finished by itself. No block may be left allocated."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        engine.abort_request((aborts or {}).get(steps, []))
        for out in engine.step():
            if out.finished and out.outputs[0].finish_reason != "abort":
                done[out.request_id] = list(out.outputs[0].token_ids)
        check_invariants(engine.state)
        assert steps < 500
    assert engine.step() == []  # a step still in flight loses nothing
    assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1
    return done


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_evicted_prefixes_come_back_from_the_host_with_the_same_outputs(
        async_scheduling: bool) -> None:
    engines = {size: offload_engine(size, async_scheduling=async_scheduling)
               for size in (None, 0.001)}
    pointer = engines[0.001].runner.kv.unsafe_buffer_pointer()
    outputs = {size: run(e) for size, e in engines.items()}
    # Every copy in and every step updated the donated pool in place, pending copies out too.
    assert engines[0.001].runner.kv.unsafe_buffer_pointer() == pointer
    for i, p in enumerate(PROMPTS):
        assert outputs[0.001][f"r{i}"] == outputs[None][f"r{i}"] == fake_greedy(p, 12, V)
    plain, offloaded = engines[None], engines[0.001]
    assert plain.kv_offload is None
    # The shared prefix was evicted (in part) before its second and third use: without
    # offloading the evicted blocks are computed again, with offloading they come back from
    # the host, so the device's hits and the host's cover the whole prefix both times.
    hits = {s: e.state.counters.prefix_cache_hits for s, e in engines.items()}
    host = offloaded.state.counters.connector_prefix_cache_hits
    assert plain.state.counters.connector_prefix_cache_hits == 0
    assert hits[0.001] + host == 2 * len(SHARED) > hits[None] == hits[0.001]
    assert host >= len(SHARED) and host % 4 == 0  # whole blocks
    computed = {s: e.runner.stats.computed_tokens for s, e in engines.items()}
    assert computed[None] - computed[0.001] == host  # exactly the loaded tokens not recomputed
    assert computed[0.001] < 0.9 * computed[None]
    assert offloaded.runner.stats.compilations_after_warmup == 0
    store = offloaded.kv_offload.store
    assert not any(h in store for h in last_blocks(outputs[0.001])[8:])  # never evicted


def test_the_host_store_stays_within_its_size_and_evicts_the_oldest() -> None:
    page = 16  # the fake model's page: 4 int32 slots
    engine = offload_engine(6 * page / GiB)  # room for 6 of the 8 shared blocks
    store = engine.kv_offload.store
    assert engine.kv_offload.copier.page_bytes == page
    seen = []
    engine.stat_loggers.append(type("L", (), {"record": lambda self, s, it: seen.append(
        (it.kv_offload_usage, len(store), store.num_bytes))})())
    outputs = run(engine)
    assert outputs == {f"r{i}": fake_greedy(p, 12, V) for i, p in enumerate(PROMPTS)}
    assert store.capacity_pages == 6 and store.evictions > 0
    assert max(n for _, n, _ in seen) == 6 and max(b for _, _, b in seen) == 6 * page
    assert seen[-1][0] == 1.0
    ample = offload_engine()
    run(ample)
    hits = engine.state.counters.connector_prefix_cache_hits
    assert hits % 4 == 0 and hits < ample.state.counters.connector_prefix_cache_hits


class SlowWorker(OffloadingWorker):
    """Reports each load `delay` outputs after it started (the copy itself is done at once):
    a store whose loads take a few steps."""

    delay = 3

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.waiting: dict[str, int] = {}  # request -> outputs to go

    def take_output(self):
        out = super().take_output()
        for rid in () if out is None else out.finished_recving:
            self.waiting[rid] = self.delay
        ready = {r for r, n in self.waiting.items() if n == 0}
        self.waiting = {r: n - 1 for r, n in self.waiting.items() if n > 0}
        if not ready:
            return None
        return KVConnectorOutput(finished_recving=frozenset(ready))


def slow_engine(**kw: Any):
    engine = offload_engine(**kw)
    engine.kv_worker = SlowWorker(engine.runner, capacity_bytes=GiB // 1000,
                                  block_size=4, page_axis=0)
    return engine


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_slow_load_waits_for_remote_kvs_while_others_run(async_scheduling: bool) -> None:
    engine = slow_engine(max_num_seqs=2, async_scheduling=async_scheduling)
    run(engine, PROMPTS[:3])  # the shared prefix ends up on the host
    assert engine.state.counters.connector_prefix_cache_hits == 0
    long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.add_request("busy", {"prompt_token_ids": [3] * 9}, long)
    engine.step()
    engine.add_request("reuse", {"prompt_token_ids": SHARED + [50, 51]}, GREEDY)
    statuses, busy_tokens = [], 0
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
        req = engine.state.requests.get("reuse")
        statuses.append(None if req is None else req.status)
        if req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            busy_tokens = len(outputs.get("busy", ()))
        check_invariants(engine.state)
    waited = statuses.count(RequestStatus.WAITING_FOR_REMOTE_KVS)
    assert waited >= SlowWorker.delay  # held back for the worker's delay ...
    assert busy_tokens >= SlowWorker.delay  # ... while the other request kept decoding
    assert outputs["reuse"] == fake_greedy(SHARED + [50, 51], 12, V)
    assert outputs["busy"] == fake_greedy([3] * 9, 20, V)
    assert engine.state.counters.connector_prefix_cache_hits == len(SHARED)
    assert engine.step() == []
    assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_abort_while_the_load_is_slow_frees_its_blocks_when_it_ends(
        async_scheduling: bool) -> None:
    engine = slow_engine(async_scheduling=async_scheduling)
    run(engine, PROMPTS[:3])
    engine.add_request("reuse", {"prompt_token_ids": SHARED + [50, 51]}, GREEDY)
    engine.step()
    engine.step()
    assert engine.state.requests["reuse"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.abort_request("reuse")
    assert engine.state.held_req_ids == {"reuse"}  # the worker may still write its blocks
    steps = 0
    while engine.has_unfinished_requests():  # steps until the load is reported
        engine.step()
        steps += 1
        assert steps < 10
    assert engine.state.held_req_ids == frozenset()
    assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1


class EagerSaveConnector(OffloadingConnector):
    """Saves every finished request's blocks as it finishes (vLLM's timing), not on eviction."""

    def request_finished(self, request, block_ids) -> bool:
        return True


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_saves_of_finished_requests_are_reported_and_release_their_blocks(
        async_scheduling: bool) -> None:
    engine = offload_engine(async_scheduling=async_scheduling)
    engine.kv_offload.connector = EagerSaveConnector(engine.kv_offload.store, 4)
    outputs = run(engine)
    assert outputs == {f"r{i}": fake_greedy(p, 12, V) for i, p in enumerate(PROMPTS)}
    c = engine.state.counters
    assert c.prefix_cache_hits + c.connector_prefix_cache_hits == 2 * len(SHARED)
    assert engine.state.held_req_ids == frozenset()
    # The last request's 11 full blocks (44 tokens with KV) were saved as it finished, though
    # nothing evicted them from the device.
    assert all(h in engine.kv_offload.store for h in last_blocks(outputs))


def last_blocks(outputs: dict[str, list[int]]) -> list[bytes]:
    """Hashes of the full blocks of the last request's KV (its prompt and outputs but the
    last, whose KV is never computed)."""
    tokens = PROMPTS[-1] + outputs[f"r{len(PROMPTS) - 1}"][:-1]
    return extend_block_hashes([], tokens, len(tokens) // 4, 4, None)


def test_aborted_requests_leak_nothing_and_the_rest_is_unchanged() -> None:
    engine = offload_engine(async_scheduling=True)
    outputs = run(engine, aborts={3: ["r0"], 40: ["r3"]})
    for i in (1, 2, 4, 5):
        assert outputs[f"r{i}"] == fake_greedy(PROMPTS[i], 12, V)


def test_metrics_count_host_hits_bytes_and_usage() -> None:
    engine = offload_engine()
    prom = PrometheusStatLogger("m", 256)
    engine.stat_loggers.append(prom)
    run(engine)
    text = prom.render().decode()
    page = engine.kv_offload.copier.page_bytes

    def value(name: str, **labels: str) -> float:
        for line in text.splitlines():
            if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} {labels} not in the exposition")

    c = engine.state.counters
    assert c.connector_prefix_cache_hits >= len(SHARED)
    assert value("jaxengine:external_prefix_cache_hits_total") == c.connector_prefix_cache_hits
    assert (value("jaxengine:external_prefix_cache_queries_total")
            == c.connector_prefix_cache_queries > c.connector_prefix_cache_hits)
    loaded = value("jaxengine:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU")
    assert loaded == c.connector_prefix_cache_hits // 4 * page  # every block loaded, once
    saved = value("jaxengine:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU")
    assert saved >= 8 * page and saved % page == 0
    assert value("jaxengine:kv_offload_size_count", transfer_type="CPU_to_GPU") == 2
    assert 0 < value("jaxengine:kv_offload_usage_perc") <= 1


def test_the_log_line_gives_the_host_hit_rate() -> None:
    engine = offload_engine()
    log = LoggingStatLogger()
    engine.stat_loggers.append(log)
    run(engine)
    c = engine.state.counters
    rate = 100 * c.connector_prefix_cache_hits / c.connector_prefix_cache_queries
    assert f", External prefix cache hit rate: {rate:.1f}%" in log.log()
    plain = LoggingStatLogger()
    engine = offload_engine(None)
    engine.stat_loggers.append(plain)
    run(engine, PROMPTS[:2])
    assert "External" not in plain.log()


@pytest.mark.parametrize(("kw", "message"), [
    (dict(kv_offloading_size=-1), "kv_offloading_size must be a finite number of GiB >= 0"),
    (dict(kv_offloading_size=float("nan")), "kv_offloading_size must be a finite number"),
    (dict(kv_offloading_size="1"), "kv_offloading_size must be a finite number"),
    (dict(kv_offloading_size=True), "kv_offloading_size must be a finite number"),
    (dict(kv_offloading_size=1, enable_prefix_caching=False),
     "kv_offloading_size needs enable_prefix_caching=True"),
])
def test_bad_offloading_sizes_are_clear_errors(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kw)


def test_a_size_below_one_block_is_refused_when_the_engine_is_built() -> None:
    with pytest.raises(ValueError, match="raise kv_offloading_size to at least"):
        offload_engine(8 / GiB)


def test_zero_or_none_is_off() -> None:
    for size in (None, 0, 0.0):
        engine = offload_engine(size)
        assert engine.kv_offload is None
        assert run(engine, PROMPTS[:2]) == {f"r{i}": fake_greedy(PROMPTS[i], 12, V)
                                            for i in range(2)}


def test_the_command_line_takes_kv_offloading_size_and_refuses_a_bad_one(capsys) -> None:
    parser = build_parser()
    ns = parser.parse_args(["serve", "--kv-offloading-size", "0.5"])
    assert engine_args_from(ns, parser).kv_offloading_size == 0.5
    ns = parser.parse_args(["serve", "--kv-offloading-size", "-2"])
    with pytest.raises(SystemExit):
        engine_args_from(ns, parser)
    assert "kv_offloading_size must be a finite number of GiB >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preempted_requests_resume_from_the_host_with_the_same_outputs(
        async_scheduling: bool) -> None:
    engine = make_engine(num_blocks=18, kv_offloading_size=0.001,
                         async_scheduling=async_scheduling)
    outputs = run(engine, ENGINE_PROMPTS)
    assert outputs == {f"r{i}": fake_greedy(p, 12, V) for i, p in enumerate(ENGINE_PROMPTS)}
    c = engine.state.counters
    assert c.num_preemptions > 0 and c.connector_prefix_cache_hits > 0
