"""Stop conditions, aborts, add_request errors and speculative-decode bookkeeping
(docs/SCHEDULING.md §4, §9)."""

import pytest

from scheduler import (
    RequestStatus,
    SchedulerConfig,
    abort_requests,
    add_request,
    check_invariants,
    init_state,
    schedule,
    update_from_output,
)

from .util import req, state_with, step

CFG = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=16,
                      block_size=4, num_blocks=20)


def _finish(s, sampler):
    """Step until no request is left; return the deltas of each request, concatenated."""
    tokens, reasons = {}, {}
    while s.requests:
        s, _, deltas = step(s, sampler)
        for d in deltas:
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.finish_reason:
                reasons[d.request_id] = (d.finish_reason, d.stop_reason)
    return s, tokens, reasons


def test_eos_stops_unless_ignored():
    s = state_with(CFG, req("A", 3, 10, eos=2), req("B", 3, 10, eos=2, ignore_eos=True))
    seq = iter([5, 2, 9, 9, 9, 9, 9, 9, 9, 9])
    s, tokens, reasons = _finish(s, lambda rid, out: [next(seq) if rid == "A" else 2])
    assert tokens["A"] == [5, 2] and reasons["A"] == ("stop", None)
    assert tokens["B"] == [2] * 10 and reasons["B"] == ("length", None)
    assert s.num_free_blocks == 19


def test_stop_token_ids_stop_and_are_the_stop_reason():
    s = state_with(CFG, req("A", 3, 10, stop_token_ids=[42]))
    seq = iter([1, 42, 3])
    s, tokens, reasons = _finish(s, lambda rid, out: [next(seq)])
    assert tokens["A"] == [1, 42] and reasons["A"] == ("stop", 42)


def test_min_tokens_suppresses_eos_and_stop_ids():
    s = state_with(CFG, req("A", 3, 10, eos=2, min_tokens=3, stop_token_ids=[4]))
    seq = iter([2, 4, 2, 8])
    s, tokens, reasons = _finish(s, lambda rid, out: [next(seq)])
    assert tokens["A"] == [2, 4, 2] and reasons["A"] == ("stop", None)


def test_max_model_len_caps_the_length():
    s = state_with(CFG, req("A", 10, 100))
    s, tokens, reasons = _finish(s, lambda rid, out: [1])
    assert len(tokens["A"]) == 6 and reasons["A"] == ("length", None)  # 10 + 6 = 16


def test_tokens_after_a_stop_are_dropped():
    # Several tokens in one step (speculative decoding): the ones after EOS are discarded.
    s = state_with(CFG, req("A", 3, 10, eos=2))
    s, out = schedule(s)
    s, deltas = update_from_output(s, out, {"A": [5, 2, 6]})
    assert deltas[0].new_token_ids == (5, 2) and deltas[0].finish_reason == "stop"


def test_finished_ids_are_reported_by_the_next_step():
    s = state_with(CFG, req("A", 3, 1), req("B", 3, 3))
    s, out, deltas = step(s)
    assert [d.request_id for d in deltas if d.finish_reason] == ["A"]
    assert "A" not in s.requests and s.running == ("B",)
    s, out, _ = step(s)
    assert out.finished_req_ids == {"A"}
    s, out, _ = step(s)
    assert out.finished_req_ids == frozenset()


def test_abort_frees_blocks_from_any_queue():
    cfg = CFG.replace(max_num_seqs=1, max_num_batched_tokens=16)
    s = state_with(cfg, req("A", 6, 10), req("B", 6, 10))
    s, _, _ = step(s)
    assert s.running == ("A",) and s.waiting == ("B",) and s.num_free_blocks == 17
    s = abort_requests(s, ["A", "nope"])
    check_invariants(s)
    assert s.num_free_blocks == 19 and s.running == () and "A" not in s.requests
    s = abort_requests(s, ["B"])
    assert not s.requests and s.waiting == ()
    s, out = schedule(s)
    assert out.finished_req_ids == {"A", "B"} and out.total_num_scheduled_tokens == 0


def test_abort_between_schedule_and_update_is_tolerated():
    s = state_with(CFG, req("A", 3, 5), req("B", 3, 5))
    s, out = schedule(s)
    s = abort_requests(s, ["A"])
    s, deltas = update_from_output(s, out, {"A": [1], "B": [1]})
    assert [d.request_id for d in deltas] == ["B"] and s.num_free_blocks == 18


@pytest.mark.parametrize("bad, message", [
    (req("A", 3), "already"),
    (req("E", ()), "empty"),
    (req("L", 16), "max_model_len=16"),
])
def test_add_request_errors_name_the_request_and_leave_the_state_alone(bad, message):
    s = state_with(CFG, req("A", 3))
    with pytest.raises(ValueError, match=message) as e:
        add_request(s, bad)
    assert repr(bad.request_id) in str(e.value)
    assert list(s.requests) == ["A"] and s.waiting == ("A",)


def test_speculative_drafts_are_scheduled_and_rejections_roll_back():
    s = state_with(CFG, req("A", 4, 10))
    s, out = schedule(s)
    s, _ = update_from_output(s, out, {"A": [7]}, draft_token_ids={"A": [8, 9, 10]})
    assert s.requests["A"].spec_token_ids == (8, 9, 10)
    assert s.requests["A"].num_tokens_with_spec == 8
    s, out = schedule(s)
    assert out.num_scheduled_tokens["A"] == 4  # the new token + 3 drafts
    assert out.scheduled_spec_decode_tokens["A"] == (8, 9, 10)
    assert out.input_token_ids["A"] == (7, 8, 9, 10)
    assert s.requests["A"].num_computed_tokens == 8
    # The model accepted draft 8 and rejected 9, 10; it sampled 11 in place of 9.
    s, deltas = update_from_output(s, out, {"A": [8, 11]})
    a = s.requests["A"]
    assert deltas[0].new_token_ids == (8, 11)
    assert a.output_token_ids == (7, 8, 11) and a.spec_token_ids == ()
    assert a.num_computed_tokens == 6 == a.num_tokens - 1  # 8 - 2 rejected
    check_invariants(s)
    s, out = schedule(s)
    assert out.num_scheduled_tokens["A"] == 1 and out.input_token_ids["A"] == (11,)


def test_status_lifecycle():
    s = state_with(CFG, req("A", 3, 2))
    assert s.requests["A"].status == RequestStatus.WAITING
    s, out = schedule(s)
    assert s.requests["A"].status == RequestStatus.RUNNING
    assert not RequestStatus.RUNNING.is_finished and RequestStatus.FINISHED_ABORTED.is_finished
    assert RequestStatus.FINISHED_LENGTH_CAPPED.finish_reason == "length"


def test_decode_invariant_computed_is_num_tokens_minus_one():
    s = state_with(CFG, req("A", 5, 8), req("B", 9, 8), req("C", 2, 8))
    for _ in range(4):
        s, _, _ = step(s)
        for r in s.requests.values():
            assert r.num_computed_tokens == r.num_tokens - 1
    assert init_state(CFG).num_free_blocks == 19
