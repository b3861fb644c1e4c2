"""Stop strings: `update_from_output(..., stopped=...)` finishes the requests whose new text
matched one, in the same update (docs/SCHEDULING.md §4)."""

import pytest

from scheduler import (
    SchedulerConfig,
    abort_requests,
    check_invariants,
    schedule,
    update_from_output,
)

from .util import req, state_with, step

# 19 usable blocks of 4 tokens.
CFG = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=16,
                      block_size=4, num_blocks=20)


def test_a_stop_string_finishes_the_request_in_the_same_update():
    s = state_with(CFG, req("A", 5, 10, arrival=0.0), req("B", 3, 10, arrival=0.1))
    s, out, deltas = step(s, stopped={"A": "\n\n"})
    assert deltas == (("A", (7,), "stop", "\n\n"), ("B", (7,), None, None))
    assert "A" not in s.requests and s.running == ("B",) and s.waiting == ()
    assert s.num_free_blocks == 18  # A's 2 blocks are back, B holds 1
    s, out, deltas = step(s)
    assert out.finished_req_ids == {"A"} and dict(out.num_scheduled_tokens) == {"B": 1}
    assert deltas == (("B", (7,), None, None),)


@pytest.mark.parametrize("max_tokens, params, sampled, kept", [
    (10, dict(eos=2), [2], (2,)),  # EOS
    (10, dict(stop_token_ids=[42]), [42], (42,)),  # a stop token, else the stop_reason
    (1, {}, [9], (9,)),  # the length limit
    (10, dict(eos=2), [5, 2, 6], (5, 2)),  # several tokens (drafts): those after EOS dropped
])
def test_the_stop_string_wins_over_a_stop_of_its_own_in_the_same_step(max_tokens, params,
                                                                        sampled, kept):
    s = state_with(CFG, req("A", 3, max_tokens, **params))
    s, out = schedule(s)
    s, deltas = update_from_output(s, out, {"A": sampled}, stopped={"A": "END"})
    check_invariants(s)
    assert deltas == (("A", kept, "stop", "END"),)  # as vLLM's output processor decides
    assert not s.requests and s.num_free_blocks == 19


def test_ids_that_got_no_tokens_are_ignored_and_aborts_meanwhile_are_tolerated():
    s = state_with(CFG.replace(max_num_batched_tokens=8), req("A", 3, 5, arrival=0.0),
                   req("B", 3, 5, arrival=0.1), req("C", 6, 5, arrival=0.2))
    s, out = schedule(s)
    assert dict(out.num_scheduled_tokens) == {"A": 3, "B": 3, "C": 2}  # C's chunk samples nothing
    s = abort_requests(s, ["A"])  # while the model ran
    s, deltas = update_from_output(s, out, {"A": [1], "B": [1]},
                                   stopped={"A": "x", "B": "y", "C": "z", "nope": "w"})
    check_invariants(s)
    assert deltas == (("B", (1,), "stop", "y"),)
    assert list(s.requests) == ["C"] and s.running == ("C",)
    assert s.num_free_blocks == 18  # C holds 1 block (its first 2 tokens); A's and B's are back
    s, out = schedule(s)
    assert out.finished_req_ids == {"A", "B"} and dict(out.num_scheduled_tokens) == {"C": 4}
    assert s.num_free_blocks == 17


def test_a_stop_in_a_step_that_preempted_frees_the_blocks_the_victim_resumes_with():
    # 4 usable blocks of 4 tokens: at step 5 A and B both need a third block; B is preempted
    # (tests/scheduler/test_preemption.py), and A stops on a string in that step.
    tight = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32,
                            block_size=4, num_blocks=5, enable_prefix_caching=False)
    s = state_with(tight, req("A", 4, 10, arrival=0.0), req("B", 4, 10, arrival=0.1))
    for _ in range(5):
        s, _, _ = step(s)
    s, out, deltas = step(s, stopped={"A": "x", "B": "y"})  # B sampled nothing: ignored
    assert out.preempted_req_ids == {"B"} and dict(out.num_scheduled_tokens) == {"A": 1}
    assert deltas == (("A", (7,), "stop", "x"),)
    assert s.waiting == ("B",) and s.running == () and s.num_free_blocks == 4
    assert len(s.requests["B"].output_token_ids) == 5
    s, out, _ = step(s)
    assert dict(out.num_scheduled_tokens) == {"B": 9}  # prompt + 5 outputs, at once
    assert out.finished_req_ids == {"A"} and s.num_free_blocks == 1
