"""Purity at the boundary: no function changes its input; old states can be scheduled again.
States are values: they compare equal by content (a twin built by the same calls is equal)."""

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
    s, twin = _busy_state(), _busy_state()
    assert s == twin and s is not twin
    s2, out = schedule(s)
    assert s == twin
    mid, _ = schedule(twin)
    assert s2 == mid
    update_from_output(s2, out, {r: [3] for r in out.sampling_req_ids},
                       stopped={out.sampling_req_ids[0]: "\n"})
    assert s2 == mid
    add_request(s, req("D", 3))
    abort_requests(s, ["A"])
    assert s == twin


def test_an_old_state_schedules_to_the_same_plan_again():
    s = _busy_state()
    runs = []
    for _ in range(2):
        t, plans = s, []
        for _ in range(8):
            t, out = schedule(t)
            plans.append(out)  # every field: tokens, block tables, preemptions, ...
            t, _ = update_from_output(t, out, {r: [5] for r in out.sampling_req_ids})
        runs.append((plans, t))
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1]
    assert runs[0][1] is not runs[1][1]
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


def test_forks_keep_their_own_prefix_cache():
    # Block size 4: A's first block fills with its first output, 100 in one fork, 200 in the
    # other; each fork hashes and caches its own block, so only fork a has (1, 2, 3, 100).
    s1, out = schedule(state_with(CFG, req("A", (1, 2, 3), 12)))
    a, _ = update_from_output(s1, out, {"A": [100]})
    b, _ = update_from_output(s1, out, {"A": [200]})
    a, _, _ = step(a)  # a first: its hashes must not leak into b
    b, _, _ = step(b)
    hits = []
    for fork in (a, b):
        fork = add_request(fork, req("Q", (1, 2, 3, 100, 5), 2, arrival=1.0))
        fork, out, _ = step(fork)
        hits.append(out.num_computed_tokens["Q"])
    assert hits == [4, 0]


def test_states_are_equal_by_content():
    s, twin = _busy_state(), _busy_state()
    assert s == twin
    assert schedule(s)[0] != s  # one more step
    assert s.__eq__(object()) is NotImplemented
    with pytest.raises(TypeError):
        hash(s)  # equal states must hash alike; a state is not meant as a key
    s1, out = schedule(s)
    a, _ = update_from_output(s1, out, {r: [100] for r in out.sampling_req_ids})
    b, _ = update_from_output(s1, out, {r: [200] for r in out.sampling_req_ids})
    assert a != b  # the same everything but one token per request
    t1, out_t = schedule(twin)
    assert update_from_output(t1, out_t, {r: [100] for r in out_t.sampling_req_ids})[0] == a
    assert a != b and s == twin  # after every version was read again (rerooted)


def test_equality_sees_the_prefix_cache():
    # The same steps, prompts of the same length: only the hashes of the cached free blocks
    # differ once A has finished.
    x, y = (state_with(CFG, req("A", prompt, 1)) for prompt in ((1, 2, 3, 4, 5), (1, 2, 3, 9, 5)))
    x, _, _ = step(x)
    y, _, _ = step(y)
    assert x.free_block_queue() == y.free_block_queue() and not x.requests and not y.requests
    assert x != y
    z, _, _ = step(state_with(CFG, req("A", (1, 2, 3, 4, 5), 1)))
    assert z == x


def test_an_exception_midway_rolls_the_pool_edit_back():
    s, twin = (state_with(CFG, req("A", 3, 1, arrival=0.0), req("B", 3, 5, arrival=0.1))
               for _ in range(2))
    s, out = schedule(s)
    twin, _ = schedule(twin)
    assert s == twin
    # A finishes (its blocks are freed in the pool edit), then B's bad output raises.
    with pytest.raises(TypeError):
        update_from_output(s, out, {"A": [1], "B": 5})
    assert s == twin
    check_invariants(s)
    s, deltas = update_from_output(s, out, {"A": [1], "B": [2]})
    assert deltas[0].finish_reason == "length" and s.num_free_blocks == 5
