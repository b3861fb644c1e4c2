"""WAITING_FOR_FSM (docs/SCHEDULING.md §12): a request whose grammar is compiling is set aside
in `waiting`, the requests behind it are admitted, and it is admitted in its place once
`grammars_ready` names it. Steps are checked by hand; invariants after every call."""

import dataclasses
import random

from hypothesis import HealthCheck, given, settings

from scheduler import (
    RequestStatus,
    SchedulerConfig,
    abort_requests,
    add_request,
    check_invariants,
    grammars_ready,
    init_state,
    schedule,
    update_from_output,
)
from tests.scheduler.test_properties import _fake_model, traces
from tests.scheduler.util import req, state_with, step


def config(**kw) -> SchedulerConfig:
    base = dict(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64, block_size=4,
                num_blocks=20, enable_prefix_caching=True)
    return SchedulerConfig(**{**base, **kw})


CFG = config()
FSM = RequestStatus.WAITING_FOR_FSM


def sreq(rid: str, prompt: int, max_tokens: int = 4, **kw):
    """A request with a structured output: its grammar must be compiled first."""
    return dataclasses.replace(req(rid, prompt, max_tokens, **kw), use_structured_output=True)


def ready(s, *rids):
    s = grammars_ready(s, rids)
    check_invariants(s)
    return s


def test_a_compiling_request_waits_and_the_ones_behind_it_start():
    s = state_with(CFG, sreq("A", 6, arrival=0.0), req("B", 5, arrival=0.1),
                   req("C", 3, arrival=0.2))
    assert s.requests["A"].status == FSM and s.requests["B"].status == RequestStatus.WAITING
    # Step 0: A is set aside; B and C, behind it, are admitted.
    s, p, _ = step(s)
    assert dict(p.num_scheduled_tokens) == {"B": 5, "C": 3}
    assert [n.req_id for n in p.scheduled_new_reqs] == ["B", "C"]
    assert s.waiting == ("A",) and s.running == ("B", "C")
    assert s.requests["A"].status == FSM and s.block_table("A") == ()
    assert s.requests["A"].num_computed_tokens == 0
    assert s.block_table("B") == (1, 2) and s.block_table("C") == (3,)
    # Step 1: still compiling; B and C decode.
    s, p, _ = step(s)
    assert dict(p.num_scheduled_tokens) == {"B": 1, "C": 1} and s.waiting == ("A",)
    assert s.num_free_blocks == 19 - 3
    # The grammar is ready: step 2 admits A (6 tokens, blocks after C's second one).
    s = ready(s, "A")
    assert s.requests["A"].status == RequestStatus.WAITING and s.waiting == ("A",)
    s, p, _ = step(s)
    assert dict(p.num_scheduled_tokens) == {"B": 1, "C": 1, "A": 6}
    assert [n.req_id for n in p.scheduled_new_reqs] == ["A"]
    assert p.block_tables["A"] == (5, 6) and s.block_table("C") == (3, 4)
    assert "A" in p.sampling_req_ids and s.requests["A"].status == RequestStatus.RUNNING
    assert s.running == ("B", "C", "A") and s.waiting == ()


def test_a_grammar_ready_before_the_first_step_keeps_the_arrival_order():
    s = state_with(CFG, sreq("A", 6, arrival=0.0), req("B", 5, arrival=0.1))
    s = ready(s, "A")
    s, p, _ = step(s)
    assert dict(p.num_scheduled_tokens) == {"A": 6, "B": 5}


def test_requests_whose_grammars_finish_out_of_order_start_as_each_is_ready():
    s = state_with(CFG, sreq("A", 4, arrival=0.0), sreq("B", 4, arrival=0.1),
                   req("C", 4, arrival=0.2))
    s, p, _ = step(s)
    assert dict(p.num_scheduled_tokens) == {"C": 4} and s.waiting == ("A", "B")
    s = ready(s, "B")
    s, p, _ = step(s)
    assert dict(p.num_scheduled_tokens) == {"C": 1, "B": 4} and s.waiting == ("A",)
    s = ready(s, "A")
    s, p, _ = step(s)
    assert dict(p.num_scheduled_tokens) == {"C": 1, "B": 1, "A": 4}


def test_a_compiling_request_does_not_take_a_sequence_slot():
    cfg = config(max_num_seqs=1)
    s = state_with(cfg, sreq("A", 4, arrival=0.0), req("B", 4, 2, arrival=0.1))
    s, p, _ = step(s)
    assert dict(p.num_scheduled_tokens) == {"B": 4}
    s = ready(s, "A")
    s, p, _ = step(s)  # the one slot is B's until it finishes
    assert dict(p.num_scheduled_tokens) == {"B": 1} and p.finished_req_ids == frozenset()
    s, p, _ = step(s)
    assert dict(p.num_scheduled_tokens) == {"A": 4} and p.finished_req_ids == {"B"}


def test_a_ready_request_is_admitted_by_the_usual_rules():
    cfg = config(max_num_batched_tokens=8, max_model_len=8, enable_chunked_prefill=False)
    s = state_with(cfg, sreq("A", 7, arrival=0.0), req("B", 5, 2, arrival=0.1),
                   req("C", 3, 2, arrival=0.2))
    s, p, _ = step(s)
    assert dict(p.num_scheduled_tokens) == {"B": 5, "C": 3}
    s = ready(s, "A")
    s, p, _ = step(s)  # 6 tokens of budget left, A's 7 may not be split: it waits
    assert dict(p.num_scheduled_tokens) == {"B": 1, "C": 1}
    assert s.requests["A"].status == RequestStatus.WAITING and p.finished_req_ids == frozenset()
    s, p, _ = step(s)  # B and C finished (2 tokens each)
    assert dict(p.num_scheduled_tokens) == {"A": 7} and p.finished_req_ids == {"B", "C"}


def test_the_priority_policy_skips_a_compiling_request_then_puts_it_first():
    cfg = config(policy="priority", max_num_batched_tokens=8, max_model_len=8,
                 enable_chunked_prefill=False)
    s = state_with(cfg, sreq("A", 6, priority=0), req("B", 5, priority=1, arrival=0.1),
                   req("C", 5, priority=2, arrival=0.2))
    s, p, _ = step(s)
    assert dict(p.num_scheduled_tokens) == {"B": 5} and s.waiting == ("A", "C")
    s = ready(s, "A")
    s, p, _ = step(s)  # A (priority 0) before C; the budget of 8 holds B's 1 and A's 6
    assert dict(p.num_scheduled_tokens) == {"B": 1, "A": 6} and s.waiting == ("C",)


def test_abort_while_compiling_frees_nothing_and_a_late_ready_is_ignored():
    s = state_with(CFG, sreq("A", 6), req("B", 5, arrival=0.1))
    s, p, _ = step(s)
    free = s.num_free_blocks
    s = abort_requests(s, ["A"])
    check_invariants(s)
    assert "A" not in s.requests and s.waiting == () and s.num_free_blocks == free
    assert ready(s, "A") is s  # the compile finished after the abort: nothing to do
    s, p, _ = step(s)
    assert p.finished_req_ids == {"A"} and dict(p.num_scheduled_tokens) == {"B": 1}


def test_grammars_ready_is_pure_and_ignores_ids_it_has_nothing_to_do_for():
    s = state_with(CFG, sreq("A", 6), req("B", 5, arrival=0.1))
    before = s
    s2 = grammars_ready(s, ["A"])
    assert s.requests["A"].status == FSM and s == before  # the input is unchanged
    assert s2.requests["A"].status == RequestStatus.WAITING
    assert grammars_ready(s2, ["A", "B", "nobody"]) is s2  # ready already, no grammar, unknown
    assert grammars_ready(s, iter(["A"])) == s2  # any iterable
    again, plan = schedule(s)
    assert dict(plan.num_scheduled_tokens) == {"B": 5}
    assert schedule(s) == (again, plan)  # scheduling an old state again gives the same


def test_a_request_arriving_with_outputs_waits_too():
    r = dataclasses.replace(sreq("A", 4), output_token_ids=(9, 9))
    s = add_request(init_state(CFG), r)
    assert s.requests["A"].status == FSM
    s, p, _ = step(s)
    assert p.total_num_scheduled_tokens == 0
    s, p, _ = step(ready(s, "A"))
    assert dict(p.num_scheduled_tokens) == {"A": 6}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_random_traces_with_grammars_never_schedule_a_compiling_request(trace):
    cfg, requests, seed = trace
    rng = random.Random(seed)
    s = init_state(cfg)
    pending = sorted(requests, key=lambda x: (x[0], x[1].arrival_time))
    for _ in range(3000):
        while pending and pending[0][0] <= s.step:
            r = pending.pop(0)[1]
            s = add_request(s, dataclasses.replace(r, use_structured_output=rng.random() < 0.5))
        if not pending and not s.requests:
            break
        compiling = [r for r in s.waiting if s.requests[r].status == FSM]
        if compiling and rng.random() < 0.3:
            s = grammars_ready(s, rng.sample(compiling, rng.randint(1, len(compiling))))
        if rng.random() < 0.03 and s.requests:
            s = abort_requests(s, [rng.choice(sorted(s.requests))])
        compiling = {r for r in s.waiting if s.requests[r].status == FSM}
        s, out = schedule(s)
        check_invariants(s, out)
        assert not compiling & set(out.num_scheduled_tokens)
        assert all(s.requests[r].status == FSM for r in compiling)
        sampled, drafts = _fake_model(rng, out, s)
        s, _ = update_from_output(s, out, sampled, draft_token_ids=drafts)
        check_invariants(s)
    else:
        raise AssertionError("requests did not all finish in 3000 steps")
    assert s.num_free_blocks == cfg.num_blocks - 1
