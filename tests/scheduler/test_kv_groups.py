"""KV cache groups of a hybrid model: sliding windows free blocks (docs/SCHEDULING.md §13).

Exact-number scenarios, step by step, of allocate / free / prefix caching / preemption per
group; the pure hit and concurrency functions; and the memory a window saves, measured on the
scheduler itself against the same model with its windows removed.
"""

import random

import pytest
from hypothesis import HealthCheck, event, given, settings

from scheduler import (
    KVCacheGroup,
    KVConnector,
    SchedulerConfig,
    abort_requests,
    add_request,
    check_invariants,
    init_state,
    kv_block_layers,
    max_concurrency,
    prefix_cache_hit,
    schedule,
    update_from_output,
)
from scheduler.kv.groups import group_key, longest_hit
from scheduler.kv.kv_cache import cdiv
from scheduler.replay import replay
from tests.scheduler.test_async import Drafts, drive, workload
from tests.scheduler.test_properties import _fake_model, traces
from tests.scheduler.util import req, state_with, step

FULL, SLIDING_8 = KVCacheGroup(), KVCacheGroup(sliding_window=8)


def _config(**changes) -> SchedulerConfig:
    base = dict(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64, block_size=4,
                num_blocks=33, enable_prefix_caching=False, kv_cache_groups=(FULL, SLIDING_8))
    return SchedulerConfig(**(base | changes))


def _tables(plan, rid):
    return tuple(tables[rid] for tables in plan.group_block_tables)


def test_a_window_frees_the_blocks_it_left_step_by_step():
    # The example of docs/SCHEDULING.md §13: a 40-token prompt chunked 16 at a time.
    s = state_with(_config(), req("A", 40, max_tokens=3))
    expected = [  # (computed before, full table, sliding table, free blocks after)
        (0, (1, 2, 3, 4), (5, 6, 7, 8), 24),
        (16, (1, 2, 3, 4, 5, 6, 9, 10), (0, 0, 7, 8, 11, 12, 13, 14), 18),
        (32, (1, 2, 3, 4, 5, 6, 9, 10, 7, 8), (0, 0, 0, 0, 0, 0, 13, 14, 11, 12), 18),
        (40, (1, 2, 3, 4, 5, 6, 9, 10, 7, 8, 13), (0,) * 8 + (11, 12, 14), 18),
    ]
    for computed, full, sliding, free in expected:
        s, plan, _ = step(s)
        assert plan.num_computed_tokens == {"A": computed}
        assert _tables(plan, "A") == (full, sliding) == s.group_block_tables("A")
        assert plan.block_tables["A"] == full == s.block_table("A")
        assert s.num_free_blocks == free
    s, plan, deltas = step(s)  # the third output: A finishes and gives every block back
    assert deltas[0].finish_reason == "length"
    assert s.num_free_blocks == 32 and s.group_block_tables("A") == ((), ())


def test_the_same_prompt_with_two_full_groups_holds_every_block():
    s = state_with(_config(kv_cache_groups=(FULL, FULL)), req("A", 40, max_tokens=3))
    for free in (24, 16, 12):
        s, plan, _ = step(s)
        assert s.num_free_blocks == free
    assert _tables(plan, "A")[1] == (5, 6, 7, 8, 13, 14, 15, 16, 19, 20)


def test_one_full_group_plans_as_before():
    s = state_with(SchedulerConfig(block_size=4, num_blocks=10), req("A", 6))
    s, plan, _ = step(s)
    assert plan.group_block_tables == (plan.block_tables,)
    assert s.group_block_tables("A") == ((1, 2),) and s.block_table("A") == (1, 2)


def test_a_sliding_prefix_hit_takes_only_the_blocks_in_the_window():
    s = state_with(_config(enable_prefix_caching=True), a := req("A", 40, max_tokens=1))
    for _ in range(3):
        s, plan, _ = step(s)
    assert _tables(plan, "A") == ((1, 2, 3, 4, 9, 10, 11, 12, 17, 18),
                                  (0, 0, 0, 0, 0, 0, 15, 16, 19, 20))
    assert not s.requests and s.num_free_blocks == 32  # freed, still cached
    b = req("B", a.prompt_token_ids + (1, 2, 3, 4), max_tokens=1)  # 44 tokens: 10 hittable
    assert prefix_cache_hit(s, b) == 40
    s, plan, _ = step(add_request(s, b))
    assert plan.num_computed_tokens == {"B": 40} and plan.num_scheduled_tokens == {"B": 4}
    # Full: all ten hit blocks; sliding: the two its window needs, behind eight nulls.
    assert _tables(plan, "B") == ((1, 2, 3, 4, 9, 10, 11, 12, 17, 18, 21),
                                  (0,) * 8 + (19, 20, 22))
    assert s.counters.prefix_cache_hits == 40
    assert s.num_free_blocks == 32


def _cache(full_positions, sliding_positions, hashes):
    """A prefix cache holding block 100+i (full) and 200+i (sliding) at the given positions."""
    cached = {group_key(0, hashes[i]): (100 + i,) for i in full_positions}
    cached |= {group_key(1, hashes[i]): (200 + i,) for i in sliding_positions}
    return cached


@pytest.mark.parametrize("full, sliding, hit", [
    (range(10), [0, 1, 2, 5, 6], ((100, 101, 102, 103, 104, 105, 106), (0,) * 5 + (205, 206))),
    (range(10), [0, 1, 2], ((100, 101, 102), (0, 201, 202))),
    (range(4), range(10), ((100, 101, 102, 103), (0, 0, 202, 203))),
    (range(10), [0], ((100,), (200,))),  # no run of k = 2: the run from block 0
    # Block 0 has left the window of token 16: it need not be cached.
    (range(10), [1, 2, 3], ((100, 101, 102, 103), (0, 0, 202, 203))),
    (range(10), [1, 3], ((), ())),
    ([], range(10), ((), ())),
])
def test_the_hit_is_what_every_group_supports(full, sliding, hit):
    # Block size 4, window 8 (k = 2 blocks), a 44-token request: at most 10 blocks hit.
    hashes = [bytes([i]) * 32 for i in range(10)]
    assert longest_hit(_cache(full, sliding, hashes), hashes, (None, 8), 4) == hit


def test_preemption_frees_every_group():
    cfg = _config(max_num_batched_tokens=32, num_blocks=13)
    s = state_with(cfg, req("A", 12, max_tokens=8), req("B", 12, max_tokens=8))
    s, plan, _ = step(s)
    assert _tables(plan, "B") == ((7, 8, 9), (10, 11, 12)) and s.num_free_blocks == 0
    # A's next token needs a block in each group; its window frees block 4, B is preempted.
    s, plan, _ = step(s)
    assert plan.preempted_req_ids == {"B"} and plan.num_scheduled_tokens == {"A": 1}
    assert _tables(plan, "A") == ((1, 2, 3, 10), (0, 5, 6, 11))
    assert s.group_block_tables("B") == ((), ()) and s.num_free_blocks == 5
    assert s.free_block_queue() == (12, 7, 8, 9, 4)
    # B's whole sequence needs 3 + 3 blocks: it waits (5 free).
    s, plan, _ = step(s)
    assert plan.num_scheduled_tokens == {"A": 1} and s.waiting == ("B",)


def test_admission_reserves_only_what_a_window_holds():
    # 60 tokens: 15 blocks in the full group; the sliding group holds at most
    # cdiv(min(8 - 1 + 16, 60), 4) + 1 = 7 of them at once: 22 blocks reserved.
    for num_blocks, admitted in ((22, False), (23, True)):
        s = state_with(_config(num_blocks=num_blocks), req("A", 60, max_tokens=1))
        s, plan, _ = step(s)
        assert ("A" in plan.num_scheduled_tokens) == admitted
    # With two full groups the same request needs 30.
    s = state_with(_config(num_blocks=30, kv_cache_groups=(FULL, FULL)), req("A", 60))
    assert not schedule(s)[1].num_scheduled_tokens


def test_a_kv_connector_is_refused_with_several_groups():
    s = state_with(_config(), req("A", 4))
    with pytest.raises(ValueError, match="kv_cache_groups=.*KV connector"):
        schedule(s, kv_connector=object())
    with pytest.raises(ValueError, match="kv_cache_groups"):
        abort_requests(s, ["A"], kv_connector=object())


@pytest.mark.parametrize("changes, field", [
    (dict(kv_cache_groups=()), "kv_cache_groups=()"),
    (dict(kv_cache_groups=[KVCacheGroup()]), "kv_cache_groups="),
    (dict(kv_cache_groups=(None,)), "kv_cache_groups="),
])
def test_bad_groups_are_refused_naming_the_field(changes, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        _config(**changes)


@pytest.mark.parametrize("kwargs, field", [
    (dict(sliding_window=0), "sliding_window=0"),
    (dict(num_layers=0), "num_layers=0"),
    (dict(sliding_window=4.5), "sliding_window=4.5"),
])
def test_a_bad_group_is_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        KVCacheGroup(**kwargs)


def _gemma3_shaped(window: int) -> tuple[KVCacheGroup, ...]:
    # vLLM's grouping of 6 layers, 5 local : 1 global: one full and five sliding groups.
    return (KVCacheGroup(),) + (KVCacheGroup(sliding_window=window),) * 5


@pytest.mark.parametrize("step_tokens, per_request, hybrid", [
    (1, 256 + 5 * 33, 36.48), (256, 256 + 5 * 49, 30.66), (2048, 256 + 5 * 161, 14.48)])
def test_max_concurrency_of_a_gemma3_shaped_pool(step_tokens, per_request, hybrid):
    # The table of docs/SCHEDULING.md §13: W = 512, N = 8W, the bytes of 15,360 one-layer
    # blocks, against the same model with its windows removed (one group of 6 layers).
    groups, no_windows = _gemma3_shaped(512), (KVCacheGroup(num_layers=6),)
    budget = 15_360  # one-layer blocks
    assert kv_block_layers(groups) == 1 and kv_block_layers(no_windows) == 6
    x = max_concurrency(groups, num_blocks=budget // kv_block_layers(groups) + 1,
                        block_size=16, num_tokens=4096, max_num_batched_tokens=step_tokens)
    x_full = max_concurrency(no_windows, num_blocks=budget // 6 + 1, block_size=16,
                             num_tokens=4096, max_num_batched_tokens=step_tokens)
    assert x == pytest.approx(budget / per_request) and round(x, 2) == hybrid
    assert x_full == 10.0
    assert (x / x_full >= 2.5) == (step_tokens <= 256)


def _most_running(groups, num_blocks, max_num_seqs, window=32, n=40):
    """Run n requests of 8 windows of prompt (and 4 outputs) to the end; the most running
    at once and the preemptions."""
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=max_num_seqs,
                          max_model_len=10 * window, long_prefill_token_threshold=16,
                          block_size=4, num_blocks=num_blocks, enable_prefix_caching=False,
                          kv_cache_groups=groups)
    s = state_with(cfg, *[req(f"r{i:02d}", 8 * window, max_tokens=4) for i in range(n)])
    most = 0
    while s.requests:
        s, plan = schedule(s)
        s, _ = update_from_output(s, plan, {r: [7] for r in plan.sampling_req_ids})
        most = max(most, len(s.running))
    return most, s.counters.num_preemptions


def test_windows_run_more_long_requests_at_once_in_the_same_bytes():
    # 3,840 one-layer blocks: 640 blocks of 6 layers without windows, 3,840 with them.
    no_windows = (KVCacheGroup(num_layers=6),)
    assert _most_running(no_windows, 641, max_num_seqs=9) == (9, 0)
    most, preempted = _most_running(no_windows, 641, max_num_seqs=10)
    assert preempted > 0  # 10 requests of 65 blocks do not fit in 640
    most, preempted = _most_running(_gemma3_shaped(32), 3841, max_num_seqs=64)
    assert preempted == 0 and most >= 2.5 * 9


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_random_traces_with_windows_keep_invariants_and_return_every_block(trace):
    cfg, requests, seed = trace
    rng = random.Random(seed)
    groups = (SLIDING_8, FULL, KVCacheGroup(sliding_window=rng.choice([1, 3, 16])))
    # Enough for any one request in all three groups, and little more: preemptions happen.
    cfg = cfg.replace(kv_cache_groups=groups, num_blocks=3 * cdiv(
        cfg.max_model_len, cfg.block_size) + 1 + rng.randint(0, 12))
    s = init_state(cfg)
    pending = sorted(requests, key=lambda x: (x[0], x[1].arrival_time))
    for i in range(3000):
        while pending and pending[0][0] <= i:
            s = add_request(s, pending.pop(0)[1])
        if not pending and not s.requests:
            break
        if rng.random() < 0.03 and s.requests:
            s = abort_requests(s, [rng.choice(sorted(s.requests))])
        before = s
        s, plan = schedule(s)
        check_invariants(s, plan)
        if rng.random() < 0.2:  # the state before is intact: scheduling it again agrees
            assert schedule(before) == (s, plan)
        if plan.preempted_req_ids:
            event("preempted")
        if any(r.num_computed_tokens for r in plan.scheduled_new_reqs):
            event("prefix hit")
        for rid in plan.num_scheduled_tokens:
            tables = _tables(plan, rid)
            assert tables == s.group_block_tables(rid) and len(set(map(len, tables))) == 1
            for window, table in zip((8, None, groups[2].sliding_window), tables, strict=True):
                if window is not None:  # nothing the step's first token can see is null
                    first = plan.num_computed_tokens[rid]
                    assert 0 not in table[max(0, first - window + 1) // cfg.block_size:]
                    if 0 in table:
                        event("a window freed blocks")
        sampled, drafts = _fake_model(rng, plan, s)
        s, _ = update_from_output(s, plan, sampled, draft_token_ids=drafts)
        check_invariants(s)
    else:
        raise AssertionError("requests did not all finish in 3000 steps")
    assert s.num_free_blocks == cfg.num_blocks - 1


def test_a_trace_gives_groups_as_json():
    trace = {"config": {"max_num_batched_tokens": 16, "max_num_seqs": 4, "max_model_len": 64,
                        "block_size": 4, "num_blocks": 33, "enable_prefix_caching": False,
                        "kv_cache_groups": [{}, {"sliding_window": 8}]},
             "requests": [{"id": "A", "prompt_token_ids": list(range(40)), "max_tokens": 3}]}
    free = [record["num_free_blocks"] for record in replay(trace)]
    assert free == [24, 18, 18, 18, 32]  # the §13 example, then A finishes


@pytest.mark.parametrize("seed", range(3))
def test_async_scheduling_and_drafts_with_windows_give_the_sync_tokens(seed):
    # test_async's fake device checks every plan's inputs; a tight pool preempts.
    kw = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=80, block_size=4,
              num_blocks=48, kv_cache_groups=(SLIDING_8, FULL))
    requests = workload(seed, 12, eos=3 if seed % 2 else None, shared_prefix=8)
    sync, _ = drive(SchedulerConfig(**kw), requests, async_=False)
    asyn, _ = drive(SchedulerConfig(**kw, async_scheduling=True), requests, async_=True)
    drafted, _ = drive(SchedulerConfig(**kw, async_scheduling=True), requests, async_=True,
                       drafts=Drafts(3, seed))
    assert asyn == sync == drafted and len(sync) == len(requests)


def test_one_full_group_of_any_size_schedules_as_without_groups():
    # num_layers only counts bytes: the engine gives a model of full attention alone one
    # group of all its layers, which must be the scheduler of §1-§12 step for step.
    runs = []
    for groups in ((FULL,), (KVCacheGroup(num_layers=6),)):
        s = state_with(_config(num_blocks=20, kv_cache_groups=groups,
                               enable_prefix_caching=True),
                       req("A", 40, max_tokens=8), req("B", 30, max_tokens=8))
        plans = []
        while s.requests:
            s, plan, _ = step(s)
            plans.append((plan.num_scheduled_tokens, plan.block_tables, plan.preempted_req_ids,
                          s.free_block_queue()))
        runs.append(plans)
    assert runs[0] == runs[1] and any(p[2] for p in runs[0])  # with a preemption
    s = state_with(_config(kv_cache_groups=(KVCacheGroup(num_layers=6),)), req("A", 4))
    assert schedule(s, kv_connector=KVConnector())[1].num_scheduled_tokens == {"A": 4}
