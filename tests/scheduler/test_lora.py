"""Multi-LoRA in the scheduler (docs/SCHEDULING.md §14): the per-step `max_loras` limit sets a
waiting request aside in its place and never preempts, and the prefix cache keys blocks by
adapter. Steps are checked by hand; `step` checks the invariants (the limit among them)."""

import dataclasses

import pytest

from scheduler import (
    LoRARequest,
    SchedulerConfig,
    add_request,
    check_invariants,
    init_state,
    prefix_cache_hit,
    schedule,
    update_from_output,
)
from scheduler.kv.hashing import extend_block_hashes
from tests.scheduler.util import req, state_with, step

X = LoRARequest("x", 1, "/adapters/x")
Y = LoRARequest("y", 2, "/adapters/y")


def config(**kw) -> SchedulerConfig:
    base = dict(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64, block_size=4,
                num_blocks=20, max_loras=1)
    return SchedulerConfig(**{**base, **kw})


def lreq(rid: str, prompt, lora: LoRARequest | None, max_tokens: int = 2, **kw):
    return dataclasses.replace(req(rid, prompt, max_tokens, **kw), lora_request=lora)


def test_the_adapter_limit_sets_requests_aside_in_their_place():
    # The §14 example, step by step.
    s = state_with(config(), lreq("A", 3, None, arrival=0), lreq("B", 5, X, arrival=1),
                   lreq("C", 4, Y, arrival=2), lreq("D", 2, X, arrival=3))
    s, p, _ = step(s)
    assert dict(p.num_scheduled_tokens) == {"A": 3, "B": 5, "D": 2}
    assert s.waiting == ("C",) and s.running == ("A", "B", "D")
    assert s.requests["C"].num_computed_tokens == 0 and s.block_table("C") == ()
    s = add_request(s, lreq("E", 3, Y, arrival=4))
    s = add_request(s, lreq("F", 2, None, arrival=5))
    s, p, deltas = step(s)
    assert dict(p.num_scheduled_tokens) == {"A": 1, "B": 1, "D": 1, "F": 2}
    assert s.waiting == ("C", "E")  # both set aside, C still first
    assert [d.request_id for d in deltas if d.finish_reason] == ["A", "B", "D"]
    s, p, deltas = step(s)
    assert dict(p.num_scheduled_tokens) == {"F": 1, "C": 4, "E": 3}
    assert [d.request_id for d in deltas if d.finish_reason] == ["F"]
    s, p, deltas = step(s)
    assert dict(p.num_scheduled_tokens) == {"C": 1, "E": 1}
    assert not s.requests and s.num_free_blocks == 19


def test_running_requests_keep_running_and_the_other_adapter_waits():
    # X decodes for 6 steps with budget to spare; Y is never admitted beside it and X is never
    # preempted for it. The step after X finishes, Y starts.
    s = state_with(config(), lreq("X1", 4, X, max_tokens=6), lreq("Y1", 4, Y))
    for _ in range(6):
        s, p, deltas = step(s)
        assert list(p.num_scheduled_tokens) == ["X1"] and not p.preempted_req_ids
        assert s.waiting == ("Y1",)
    assert [d.finish_reason for d in deltas] == ["length"]
    s, p, _ = step(s)
    assert dict(p.num_scheduled_tokens) == {"Y1": 4}


def test_a_set_aside_request_stays_ahead_of_those_the_step_did_not_reach():
    # max_num_seqs=2 ends the pass after F: G, never looked at, stays behind C.
    s = state_with(config(max_num_seqs=2), lreq("B", 2, X, max_tokens=4), lreq("C", 2, Y),
                   lreq("F", 2, None), lreq("G", 2, None))
    s, p, _ = step(s)
    assert list(p.num_scheduled_tokens) == ["B", "F"] and s.waiting == ("C", "G")


def test_two_adapters_fit_with_max_loras_2_and_a_third_waits():
    Z = LoRARequest("z", 3, "/adapters/z")
    s = state_with(config(max_loras=2), lreq("A", 2, X), lreq("B", 2, Z), lreq("C", 2, Y),
                   lreq("D", 2, X), lreq("E", 2, None))
    s, p, _ = step(s)
    assert list(p.num_scheduled_tokens) == ["A", "B", "D", "E"] and s.waiting == ("C",)


def test_under_priority_a_set_aside_request_returns_to_its_sort_position():
    s = state_with(config(policy="priority"), lreq("A", 3, X, priority=1),
                   lreq("B", 3, Y, priority=0), lreq("C", 3, Y, priority=2))
    # B (Y) is first by priority and takes the step's adapter slot: A (X) is set aside.
    s, p, _ = step(s)
    assert list(p.num_scheduled_tokens) == ["B", "C"] and s.waiting == ("A",)
    s = add_request(s, lreq("D", 3, X, priority=2))
    s = add_request(s, lreq("E", 3, X, priority=0))
    s, p, _ = step(s)
    assert s.waiting == ("E", "A", "D")  # the priority order, though all three were set aside


def test_a_running_request_that_sat_a_step_out_waits_behind_a_new_adapter():
    # Async scheduling: "a" (X) sits a step out while its drafts are in flight, so "b" (Y) is
    # admitted beside it, as vLLM would. Both are then running: vLLM would assert; here the
    # second in `running` gets nothing in a step the first is planned, and nobody is preempted.
    s = add_request(init_state(config(max_num_batched_tokens=64, async_scheduling=True)),
                    lreq("a", 5, X, max_tokens=5))
    s, p1 = schedule(s)  # the prompt
    s, p2 = schedule(s)  # output 1, behind output 0's placeholder
    s, _ = update_from_output(s, p1, {"a": [9]}, {"a": [1, 2, 3]})
    s, p3 = schedule(s)  # output 1's placeholder and the drafts
    s, _ = update_from_output(s, p2, {"a": [7]})
    s = add_request(s, lreq("b", 3, Y, max_tokens=3))
    s, p4 = schedule(s)
    check_invariants(s, p4)
    assert dict(p4.num_scheduled_tokens) == {"b": 3} and s.running == ("a", "b")
    s, _ = update_from_output(s, p3, {"a": [1, 5]})
    s, p5 = schedule(s)
    check_invariants(s, p5)
    assert dict(p5.num_scheduled_tokens) == {"a": 1} and not p5.preempted_req_ids
    s, _ = update_from_output(s, p4, {"b": [7]})
    s, p6 = schedule(s)  # "a" surely finishes with the token in flight: it sits out, b runs
    check_invariants(s, p6)
    assert dict(p6.num_scheduled_tokens) == {"b": 1}


def test_prefix_blocks_are_keyed_by_adapter():
    prompt = tuple(range(100, 109))  # 9 tokens: at most 2 blocks of 4 can hit
    s = state_with(config(), lreq("A", prompt, None, max_tokens=8))
    s, p, _ = step(s)
    assert dict(p.num_scheduled_tokens) == {"A": 9}
    s = add_request(s, lreq("B", prompt, X, max_tokens=8))
    s = add_request(s, lreq("C", prompt, None, max_tokens=8))
    s, p, _ = step(s)
    assert dict(p.num_scheduled_tokens) == {"A": 1, "B": 9, "C": 1}
    assert p.num_computed_tokens["B"] == 0 and p.num_computed_tokens["C"] == 8
    assert s.block_table("C")[:2] == s.block_table("A")[:2]
    assert not set(s.block_table("B")) & set(s.block_table("A"))
    s = add_request(s, lreq("D", prompt, X, max_tokens=8))
    s, p, _ = step(s)
    assert p.num_scheduled_tokens["D"] == 1 and s.block_table("D")[:2] == s.block_table("B")[:2]
    assert prefix_cache_hit(s, lreq("Q", prompt, Y)) == 0
    assert prefix_cache_hit(s, lreq("Q", prompt, X)) == 8
    assert prefix_cache_hit(s, lreq("Q", prompt, None)) == 8


def test_block_hashes_take_the_adapter_name_on_every_block():
    tokens = list(range(12))
    base = extend_block_hashes([], tokens, 3, 4, None)
    x = extend_block_hashes([], tokens, 3, 4, None, lora_name="x")
    assert all(a != b for a, b in zip(base, x, strict=True))
    # Chained from the same parent, a block's hash still differs by adapter.
    assert extend_block_hashes(base[:1], tokens, 2, 4, None, lora_name="x")[0] != base[1]
    assert extend_block_hashes(x[:2], tokens, 3, 4, None, lora_name="x") == x[2:]
    assert x != extend_block_hashes([], tokens, 3, 4, None, lora_name="y")


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_max_loras_must_be_none_or_a_non_negative_int(value):
    with pytest.raises(ValueError, match=f"max_loras={value!r}"):
        config(max_loras=value)


@pytest.mark.parametrize("max_loras", [None, 0])
def test_an_adapter_is_refused_while_lora_is_off(max_loras):
    s = init_state(config(max_loras=max_loras))
    with pytest.raises(ValueError, match=f"request 'A'.*lora_name='x'.*max_loras={max_loras}"):
        add_request(s, lreq("A", 3, X))
    s = add_request(s, lreq("B", 3, None))  # the base model is served as before
    assert dict(schedule(s)[1].num_scheduled_tokens) == {"B": 3}


@pytest.mark.parametrize("kwargs, field", [
    (dict(lora_name="", lora_int_id=1, lora_path="/p"), "lora_name=''"),
    (dict(lora_name="x", lora_int_id=0, lora_path="/p"), "lora_int_id=0"),
    (dict(lora_name="x", lora_int_id=True, lora_path="/p"), "lora_int_id=True"),
    (dict(lora_name="x", lora_int_id=1, lora_path=""), "lora_path=''"),
])
def test_lora_request_validates_its_fields(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LoRARequest(**kwargs)


def test_a_request_refuses_a_lora_request_of_another_type():
    with pytest.raises(ValueError, match="lora_request='x' must be a LoRARequest"):
        lreq("A", 3, "x")
