"""Purity at the boundary: no function changes its input; old states can be scheduled again."""

import pickle

import pytest

from scheduler import (
    SchedulerConfig,
    abort_requests,
    add_request,
    check_invariants,
    schedule,
    update_from_output,
)

from .util import req, state_with, step

CFG = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32,
                      block_size=4, num_blocks=7)


def _busy_state():
    s = state_with(CFG, req("A", 9, 12, arrival=0.0), req("B", 5, 12, arrival=0.1),
                   req("C", tuple(range(1, 10)), 12, arrival=0.2))
    for _ in range(3):
        s, _, _ = step(s)
    return s


def test_no_function_changes_its_input():
    s = _busy_state()
    before = pickle.dumps(s)
    s2, out = schedule(s)
    assert pickle.dumps(s) == before
    mid = pickle.dumps(s2)
    update_from_output(s2, out, {r: [3] for r in out.sampling_req_ids})
    assert pickle.dumps(s2) == mid
    add_request(s, req("D", 3))
    abort_requests(s, ["A"])
    assert pickle.dumps(s) == before


def test_an_old_state_schedules_to_the_same_plan_again():
    s = _busy_state()
    runs = []
    for _ in range(2):
        t, plans = s, []
        for _ in range(8):
            t, out = schedule(t)
            plans.append((dict(out.num_scheduled_tokens), dict(out.block_tables),
                          out.preempted_req_ids))
            t, _ = update_from_output(t, out, {r: [5] for r in out.sampling_req_ids})
        runs.append((plans, pickle.dumps(t)))
    assert runs[0] == runs[1]
    check_invariants(s)


def test_forks_diverge_independently():
    s = _busy_state()
    s1, out = schedule(s)
    a, _ = update_from_output(s1, out, {r: [100] for r in out.sampling_req_ids})
    b, _ = update_from_output(s1, out, {r: [200] for r in out.sampling_req_ids})
    a, _, _ = step(a, 101)
    b, _, _ = step(b, 201)
    base = {rid: r.output_token_ids for rid, r in s1.requests.items()}
    seen_a, seen_b = set(), set()
    for rid in base:
        out_a, out_b = a.requests[rid].output_token_ids, b.requests[rid].output_token_ids
        assert out_a[:len(base[rid])] == out_b[:len(base[rid])] == base[rid]
        seen_a |= set(out_a[len(base[rid]):])
        seen_b |= set(out_b[len(base[rid]):])
    assert seen_a == {100, 101} and seen_b == {200, 201}
    assert {rid: r.output_token_ids for rid, r in s1.requests.items()} == base
    check_invariants(a)
    check_invariants(b)


def test_pickle_round_trip_continues_identically():
    s = _busy_state()
    clone = pickle.loads(pickle.dumps(s))
    for state in (s, clone):
        check_invariants(state)
    x, out_x = schedule(s)
    y, out_y = schedule(clone)
    assert dict(out_x.num_scheduled_tokens) == dict(out_y.num_scheduled_tokens)
    assert dict(out_x.block_tables) == dict(out_y.block_tables)
    assert pickle.dumps(x) == pickle.dumps(y)


def test_an_exception_midway_rolls_the_pool_edit_back():
    s = state_with(CFG, req("A", 3, 1, arrival=0.0), req("B", 3, 5, arrival=0.1))
    s, out = schedule(s)
    before = pickle.dumps(s)
    # A finishes (its blocks are freed in the pool edit), then B's bad output raises.
    with pytest.raises(TypeError):
        update_from_output(s, out, {"A": [1], "B": 5})
    assert pickle.dumps(s) == before
    check_invariants(s)
    s, deltas = update_from_output(s, out, {"A": [1], "B": [2]})
    assert deltas[0].finish_reason == "length" and s.num_free_blocks == 5
