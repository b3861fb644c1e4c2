"""The scheduler side of a KV connector (docs/SCHEDULING.md §11), step by step.

`Store` is a fake external store: it holds a prefix of some requests' tokens and answers as a
connector would. The worker side is the test itself: it decides when a load finishes (or
fails) and says so in the `KVConnectorOutput` of a later update, which makes the store slow.
"""

import json
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as hst

from scheduler import (
    KVConnector,
    KVConnectorOutput,
    KVLoad,
    RequestStatus,
    SchedulerConfig,
    abort_requests,
    add_request,
    check_invariants,
    prefix_cache_hit,
    schedule,
    update_from_output,
)
from scheduler.kv.hashing import extend_block_hashes
from scheduler.replay import replay

from .util import req, state_with

CFG = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64,
                      block_size=4, num_blocks=20)
USABLE = CFG.num_blocks - 1


class Store(KVConnector):
    """Holds the first `prefix[rid]` tokens of some requests; `unknown`: ids whose lookup is
    still in flight (answers None); `save`: hold every finished request's blocks to save."""

    def __init__(self, prefix: dict[str, int] | None = None, *, load_async: bool = True,
                 unknown: frozenset[str] = frozenset(), save: bool = False) -> None:
        self.prefix = prefix or {}
        self.load_async = load_async
        self.unknown = unknown
        self.save = save
        self.asked: list[tuple[str, int]] = []  # the test's record; answers never depend on it

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.asked.append((request.request_id, num_computed_tokens))
        if request.request_id in self.unknown:
            return None, False
        n = max(0, self.prefix.get(request.request_id, 0) - num_computed_tokens)
        return n, self.load_async and n > 0

    def request_finished(self, request, block_ids):
        return self.save


def kstep(s, connector, kv_output=None, token=7):
    """schedule + update with the connector, invariants checked; returns (state, plan)."""
    s, plan = schedule(s, connector)
    check_invariants(s, plan)
    sampled = {rid: [token] for rid in plan.sampling_req_ids}
    s, _ = update_from_output(s, plan, sampled, kv_connector=connector,
                              kv_connector_output=kv_output)
    check_invariants(s)
    return s, plan


def done(*recving, sending=(), invalid=()):
    return KVConnectorOutput(finished_recving=frozenset(recving),
                             finished_sending=frozenset(sending),
                             invalid_block_ids=frozenset(invalid))


def test_an_async_load_is_skipped_then_resumes_with_the_loaded_prefix():
    store = Store({"A": 8})  # 8 of A's 10 prompt tokens are stored
    s = state_with(CFG, req("A", 10, 4, arrival=0.0), req("B", 5, 4, arrival=0.1))
    # Step 0: A's blocks (for its whole prompt) are allocated, 8 tokens are to be loaded into
    # the first two, and A waits; B, behind it, starts.
    s, p = kstep(s, store)
    assert dict(p.num_scheduled_tokens) == {"B": 5}
    assert p.kv_connector_metadata.loads == (
        KVLoad(req_id="A", block_ids=(1, 2, 3), num_computed_tokens=0, num_external_tokens=8,
               load_async=True),)
    assert s.waiting == ("A",) and s.requests["A"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert s.block_table("A") == (1, 2, 3) and s.block_table("B") == (4, 5)
    assert s.requests["A"].num_computed_tokens == 8
    # Loaded blocks enter the prefix cache only once the load is done.
    assert prefix_cache_hit(s, req("A2", tuple(s.requests["A"].prompt_token_ids))) == 0
    # Step 1: the load is still running; A is skipped, nothing new is asked or loaded.
    s, p = kstep(s, store, done("A"))  # the worker reports it done with this step's output
    assert dict(p.num_scheduled_tokens) == {"B": 1} and p.kv_connector_metadata.loads == ()
    # Step 2: A resumes with num_computed_tokens = 8 and computes its last 2 prompt tokens.
    s, p = kstep(s, store)
    assert dict(p.num_scheduled_tokens) == {"B": 1, "A": 2}
    assert p.num_computed_tokens["A"] == 8 and p.block_tables["A"] == (1, 2, 3)
    assert [(n.req_id, n.num_computed_tokens) for n in p.scheduled_new_reqs] == [("A", 8)]
    assert "A" in p.sampling_req_ids and s.requests["A"].status == RequestStatus.RUNNING
    assert prefix_cache_hit(s, req("A2", tuple(s.requests["A"].prompt_token_ids))) == 8
    assert store.asked == [("A", 0), ("B", 0)]  # A was asked once, at its first admission
    c = s.counters
    assert (c.prefix_cache_queries, c.prefix_cache_hits) == (15, 0)
    assert (c.connector_prefix_cache_queries, c.connector_prefix_cache_hits) == (15, 8)


def test_a_lookup_in_flight_skips_only_that_request():
    s = state_with(CFG, req("A", 10, 4, arrival=0.0), req("B", 5, 4, arrival=0.1))
    s, p = kstep(s, Store({"A": 8}, unknown=frozenset({"A"})))
    assert dict(p.num_scheduled_tokens) == {"B": 5} and s.block_table("A") == ()
    assert s.requests["A"].status == RequestStatus.WAITING and s.waiting == ("A",)
    s, p = kstep(s, Store({"A": 8}))  # now it knows: the load starts
    assert p.kv_connector_metadata.loads[0].req_id == "A"


def test_a_fully_loaded_prompt_recomputes_its_last_token():
    store = Store({"A": 8})
    s = state_with(CFG, req("A", 8, 2))
    s, p = kstep(s, store, done("A"))
    assert p.total_num_scheduled_tokens == 0
    s, p = kstep(s, store)
    assert dict(p.num_scheduled_tokens) == {"A": 1} and p.num_computed_tokens["A"] == 7
    assert p.input_token_ids["A"] == (s.requests["A"].prompt_token_ids[7],)
    assert p.block_tables["A"] == (1, 2) and p.sampling_req_ids == ("A",)


def test_a_synchronous_load_is_scheduled_at_once():
    store = Store({"A": 8, "F": 8}, load_async=False)
    s = state_with(CFG, req("A", 10, 2, arrival=0.0), req("F", 8, 2, arrival=0.1))
    s, p = kstep(s, store)
    # A computes its last 2 tokens in the step the load happens in; F, fully stored, its last.
    assert dict(p.num_scheduled_tokens) == {"A": 2, "F": 1}
    assert dict(p.num_computed_tokens) == {"A": 8, "F": 7}
    assert p.kv_connector_metadata.loads == (
        KVLoad(req_id="A", block_ids=(1, 2, 3), num_computed_tokens=0, num_external_tokens=8,
               load_async=False),
        KVLoad(req_id="F", block_ids=(4, 5), num_computed_tokens=0, num_external_tokens=7,
               load_async=False))
    assert set(p.sampling_req_ids) == {"A", "F"}


def test_the_connector_is_asked_past_the_local_prefix_hit():
    prompt = tuple(range(100, 112))
    s = state_with(CFG, req("A", prompt, 1))
    s, _ = kstep(s, None)  # A computes its prompt and finishes; its 3 full blocks stay cached
    s = add_request(s, req("B", prompt[:10] + (1, 2), 2))  # shares A's first 2 blocks
    store = Store({"B": 10}, load_async=False)
    s, p = kstep(s, store)
    assert store.asked == [("B", 8)]  # 2 local blocks, then 2 tokens from the store
    (load,) = p.kv_connector_metadata.loads
    assert (load.num_computed_tokens, load.num_external_tokens) == (8, 2)
    assert p.num_computed_tokens["B"] == 10 and p.num_scheduled_tokens["B"] == 2


def test_a_failed_load_truncates_to_the_blocks_before_the_first_failure():
    s = state_with(CFG, req("A", 10, 2))
    s, _ = kstep(s, Store({"A": 8}), done("A", invalid=[2]))  # block 2 (tokens 4..7) failed
    s, p = kstep(s, Store())
    assert p.num_computed_tokens["A"] == 4 and p.num_scheduled_tokens["A"] == 6
    assert p.block_tables["A"] == (1, 2, 3)


def test_a_load_that_fails_from_its_first_block_recomputes_everything():
    s = state_with(CFG, req("A", 10, 2))
    s, _ = kstep(s, Store({"A": 8}), done("A", invalid=[1, 2]))
    assert s.requests["A"].num_computed_tokens == 0
    store = Store()  # the store has lost A: it supplies nothing on the second lookup
    s, p = kstep(s, store)
    assert store.asked == [("A", 0)]  # blocks freed, admission started afresh
    assert p.num_computed_tokens["A"] == 0 and p.num_scheduled_tokens["A"] == 10
    assert s.num_free_blocks == USABLE - 3


def test_an_abort_while_loading_frees_the_blocks_once_the_load_ends():
    s = state_with(CFG, req("A", 10, 2))
    s, _ = kstep(s, Store({"A": 8}))
    s = abort_requests(s, ["A"])
    check_invariants(s)
    assert not s.requests and s.held_req_ids == {"A"}  # the worker still writes into them
    assert s.num_free_blocks == USABLE - 3
    s, p = kstep(s, Store(), done("A"))
    assert p.finished_req_ids == {"A"} and p.total_num_scheduled_tokens == 0
    assert s.held_req_ids == frozenset() and s.num_free_blocks == USABLE
    assert s.free_block_queue() == tuple(range(1, CFG.num_blocks))


def test_an_abort_after_the_load_ended_frees_at_once():
    s = state_with(CFG, req("A", 10, 2))
    s, _ = kstep(s, Store({"A": 8}), done("A"))
    s = abort_requests(s, ["A"])
    check_invariants(s)
    assert s.held_req_ids == frozenset() and s.num_free_blocks == USABLE


def test_a_finished_request_is_held_until_saved():
    store = Store(save=True)
    s = state_with(CFG, req("A", 9, 2))
    s, _ = kstep(s, store)
    s, p = kstep(s, store)  # A's second token: it finishes, its blocks are held
    assert not s.requests and s.held_req_ids == {"A"}
    assert s.num_free_blocks == USABLE - 3
    s, p = kstep(s, store)
    (save,) = p.kv_connector_metadata.saves
    prompt = req("A", 9).prompt_token_ids
    assert save.req_id == "A" and save.block_ids == (1, 2, 3)
    assert save.token_ids == prompt + (7,)  # the last sampled token has no KV
    assert save.block_hashes == tuple(extend_block_hashes([], prompt + (7, 7), 2, 4, None))
    s, p = kstep(s, store, done(sending=["A"]))
    assert p.kv_connector_metadata.saves == ()  # reported once
    assert s.held_req_ids == frozenset() and s.num_free_blocks == USABLE


def test_evicted_cached_blocks_are_reported():
    cfg = CFG.replace(num_blocks=6)  # 5 usable
    a = req("A", 12, 1)
    s = state_with(cfg, a)
    s, _ = kstep(s, None)  # A: 3 full blocks, cached, then freed to the tail
    s = add_request(s, req("B", 16, 1))  # 4 blocks: 2 free ones first, then 2 of A's
    s, p = kstep(s, Store())
    meta = p.kv_connector_metadata
    hashes = extend_block_hashes([], a.prompt_token_ids, 3, 4, None)
    # A's blocks were freed tail first to the queue's tail: 3, 2, 1; so 3 then 2 go.
    assert meta.evicted_blocks == ((3, hashes[2]), (2, hashes[1]))
    assert meta.loads == () and meta.saves == ()


def test_without_a_connector_the_plan_has_no_metadata():
    s = state_with(CFG, req("A", 10, 2))
    s, plan = schedule(s)
    assert plan.kv_connector_metadata is None


@pytest.mark.parametrize("bad", [-1, 11, 2.5, True])
def test_a_connector_answer_out_of_range_is_a_clear_error(bad):
    class Bad(KVConnector):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return bad, False

    s = state_with(CFG, req("A", 10, 2))
    with pytest.raises(ValueError, match=r"Bad: get_num_new_matched_tokens\('A', 0\)"):
        schedule(s, Bad())
    assert s.waiting == ("A",)  # the input state is unchanged


def test_an_async_load_of_nothing_is_a_clear_error():
    class Bad(KVConnector):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0, True

    with pytest.raises(ValueError, match=r"return \(0, False\)"):
        schedule(state_with(CFG, req("A", 10, 2)), Bad())


CONFORMANCE = sorted((Path(__file__).parent / "conformance").glob("c*[0-9].json"))


@pytest.mark.parametrize("trace", CONFORMANCE[::4], ids=lambda p: p.stem)
def test_a_connector_that_supplies_nothing_changes_no_step(trace):
    spec = json.loads(trace.read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # budgets above max_num_seqs * len
        assert list(replay(spec, KVConnector())) == list(replay(spec))


def test_connector_steps_are_pure():
    store = Store({"A": 8})
    s = state_with(CFG, req("A", 10, 4, arrival=0.0), req("B", 5, 4, arrival=0.1))
    s, _ = kstep(s, store)
    twin = s
    (s1, p1), (s2, p2) = schedule(s, store), schedule(s, store)
    assert s1 == s2 and p1 == p2 and s == twin
    u1, _ = update_from_output(s1, p1, {"B": [7]}, kv_connector_output=done("A"))
    assert s1 == s2
    u2, _ = update_from_output(s2, p2, {"B": [7]})
    assert u1 != u2  # the report of the finished load is part of the state


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hst.data())
def test_random_loads_failures_aborts_and_saves_never_leak_a_block(data):
    draw = data.draw
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=3, max_model_len=40,
                          block_size=4, num_blocks=draw(hst.integers(12, 24)),
                          enable_prefix_caching=draw(hst.booleans()),
                          policy=draw(hst.sampled_from(["fcfs", "priority"])))
    bases = [tuple(range(100 * k, 100 * k + 30)) for k in range(1, 4)]
    store = Store({}, load_async=draw(hst.booleans()), save=draw(hst.booleans()))
    s = state_with(cfg)
    loading: set[str] = set()  # async loads the worker has not reported yet
    sending: set[str] = set()
    for i in range(draw(hst.integers(4, 24))):
        if draw(hst.booleans()):
            rid = f"r{i}"
            prompt = draw(hst.sampled_from(bases))[:draw(hst.integers(2, 20))]
            store.prefix[rid] = draw(hst.integers(0, len(prompt)))
            s = add_request(s, req(rid, prompt, draw(hst.integers(1, 6)), arrival=float(i),
                                   priority=draw(hst.integers(0, 2))))
        if s.requests and draw(hst.integers(0, 4)) == 0:
            s = abort_requests(s, [draw(hst.sampled_from(sorted(s.requests)))],
                               kv_connector=store)
            check_invariants(s)
        s, plan, report = _random_step(s, store, loading, sending, draw)
    for _ in range(200):  # drain: every transfer is reported, every request finishes
        if not s.requests and not s.held_req_ids:
            break
        s, plan = kstep(s, store, done(*loading, sending=sending))
        loading, sending = _new_transfers(plan), {x.req_id for x in
                                                  plan.kv_connector_metadata.saves}
    assert not s.requests and not s.held_req_ids
    assert s.num_free_blocks == cfg.num_blocks - 1
    assert sorted(s.free_block_queue()) == list(range(1, cfg.num_blocks))


def _new_transfers(plan) -> set[str]:
    return {x.req_id for x in plan.kv_connector_metadata.loads if x.load_async}


def _random_step(s, store, loading, sending, draw):
    s, plan = schedule(s, store)
    check_invariants(s, plan)
    recv = {r for r in sorted(loading) if draw(hst.booleans())}
    sent = {r for r in sorted(sending) if draw(hst.booleans())}
    invalid = set()
    for rid in recv:
        table = s.block_table(rid)
        if table and draw(hst.integers(0, 3)) == 0:
            invalid.add(draw(hst.sampled_from(table)))
    loading -= recv
    sending -= sent
    loading |= _new_transfers(plan)
    sending |= {x.req_id for x in plan.kv_connector_metadata.saves}
    sampled = {rid: [7] for rid in plan.sampling_req_ids}
    s, _ = update_from_output(s, plan, sampled, kv_connector=store,
                              kv_connector_output=done(*recv, sending=sent, invalid=invalid))
    check_invariants(s)
    meta = plan.kv_connector_metadata
    for what, happened in (("async load", _new_transfers(plan)), ("load failed", invalid),
                           ("save", meta.saves), ("eviction", meta.evicted_blocks),
                           ("taken up", [r for r in plan.scheduled_new_reqs
                                         if r.num_computed_tokens])):
        if happened:
            event(what)
    return s, plan, recv


def test_requests_holding_loaded_kv_go_first_so_they_cannot_stall():
    cfg = CFG.replace(num_blocks=8, policy="priority")  # 7 usable
    s = state_with(cfg, req("A", 10, 2, priority=1, arrival=0.0))
    s, p = kstep(s, Store({"A": 8}), done("A"))  # A holds 3 blocks, loaded by the next step
    s = add_request(s, req("B", 20, 2, priority=0, arrival=1.0))  # needs 5 blocks; 4 free
    assert s.waiting == ("B", "A")  # B ranks first
    s, p = kstep(s, Store())
    # A is visited first: it holds its blocks, and only once it runs and finishes can B fit.
    assert dict(p.num_scheduled_tokens) == {"A": 2} and s.waiting == ("B",)
    s, p = kstep(s, Store())
    assert dict(p.num_scheduled_tokens) == {"A": 1}
    s, p = kstep(s, Store())
    assert dict(p.num_scheduled_tokens) == {"B": 16} and not s.held_req_ids


def test_a_preempted_request_reloaded_resumes_as_preempted():
    cfg = CFG.replace(num_blocks=6, enable_prefix_caching=False)  # 5 usable blocks
    s = state_with(cfg, req("A", 8, 6, arrival=0.0), req("B", 8, 6, arrival=0.1))
    s, _ = kstep(s, Store())
    s, p = kstep(s, Store())  # A's third block leaves none for B: B is preempted
    assert p.preempted_req_ids == {"B"} and s.requests["B"].num_tokens == 9
    for _ in range(4):  # A decodes to its 6th token; B never fits meanwhile
        s, p = kstep(s, Store())
    assert list(s.requests) == ["B"] and s.num_free_blocks == 5
    store = Store({"B": 8})
    s, p = kstep(s, store)
    assert p.kv_connector_metadata.loads == (
        KVLoad(req_id="B", block_ids=(1, 2, 5), num_computed_tokens=0, num_external_tokens=8,
               load_async=True),)
    s, p = kstep(s, store, done("B"))
    assert p.total_num_scheduled_tokens == 0
    s, p = kstep(s, store)
    # Resumed, not new: it recomputes only its one output token on top of the loaded prompt.
    assert dict(p.num_scheduled_tokens) == {"B": 1} and p.num_computed_tokens["B"] == 8
    assert p.scheduled_new_reqs == () and p.input_token_ids["B"] == (7,)
    assert s.requests["B"].num_preemptions == 1 and store.asked == [("B", 0)]
    c = s.counters
    assert (c.preempted_prefix_cache_queries, c.connector_prefix_cache_hits) == (9, 8)


def test_async_scheduling_plans_around_a_load():
    cfg = CFG.replace(async_scheduling=True)
    store = Store({"A": 8})
    s = state_with(cfg, req("A", 10, 4, arrival=0.0), req("B", 5, 4, arrival=0.1))
    s, p0 = schedule(s, store)  # A starts loading, B prefills
    s, p1 = schedule(s, store)  # before step 0's tokens are known: B's decode, A skipped
    assert dict(p1.num_scheduled_tokens) == {"B": 1} and p1.kv_connector_metadata.loads == ()
    s, _ = update_from_output(s, p0, {"B": [7]}, kv_connector_output=done("A"))
    check_invariants(s)
    s, p2 = schedule(s, store)
    assert dict(p2.num_scheduled_tokens) == {"B": 1, "A": 2}
    assert p2.num_computed_tokens["A"] == 8
    s, _ = update_from_output(s, p1, {"B": [7]})
    check_invariants(s)


def test_a_failure_outside_async_loads_is_a_clear_error():
    store = Store({"A": 8}, load_async=False)
    s = state_with(CFG, req("A", 10, 2))
    s, plan = schedule(s, store)
    with pytest.raises(ValueError, match=r"invalid_block_ids \[1\] are not blocks of an "
                                         r"asynchronous load"):
        update_from_output(s, plan, {"A": [7]}, kv_connector_output=done(invalid=[1]))


class HashStore(KVConnector):
    """Blocks stored by content (the §5 hashes), as an offloading connector keeps them."""

    def __init__(self, hashes) -> None:
        self.hashes = frozenset(hashes)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        bs = CFG.block_size
        n = 0
        for h in request.block_hashes[num_computed_tokens // bs:]:
            if h not in self.hashes:
                break
            n += bs
        return n, n > 0


def test_a_store_keyed_by_block_hash_supplies_the_blocks_past_the_local_hit():
    prompt = tuple(range(300, 318))  # 4 full blocks and 2 tokens
    hashes = extend_block_hashes([], prompt, 4, CFG.block_size, None)
    s = state_with(CFG, req("A", prompt, 2))
    s, p = kstep(s, HashStore(hashes[:3]))  # the store has the first 3 blocks
    (load,) = p.kv_connector_metadata.loads
    assert (load.num_computed_tokens, load.num_external_tokens) == (0, 12)
    s, p = kstep(s, HashStore(()), done("A"))
    s, p = kstep(s, HashStore(()))
    assert p.num_computed_tokens["A"] == 12 and p.num_scheduled_tokens["A"] == 6


def test_a_request_that_skips_reading_the_prefix_cache_never_asks_the_connector():
    # vLLM's connectors answer 0 for it (its prompt logprobs need every position computed).
    store = Store({"A": 8, "B": 8})
    s = state_with(CFG, req("A", 10, 2), req("B", 10, 2, prompt_logprobs=1))
    s, plan = kstep(s, store)
    assert [rid for rid, _ in store.asked] == ["A"]
    assert plan.num_computed_tokens["B"] == 0 and plan.num_scheduled_tokens["B"] == 10
    assert s.counters.connector_prefix_cache_queries == 10  # A's 10 tokens only
