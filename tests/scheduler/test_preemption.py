"""Preemption by recompute: who is preempted, when, where it goes, and what it recomputes."""

from scheduler import RequestStatus, SchedulerConfig, add_request

from .util import req, run, state_with, step

# 4 usable blocks of 4 tokens: two requests of 4-token prompts outgrow the pool at position 8.
TIGHT = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32,
                        block_size=4, num_blocks=5, enable_prefix_caching=False)


def test_fcfs_preempts_the_last_running_request_and_it_recomputes_prompt_and_outputs():
    _, steps = run(TIGHT, {0: [req("A", 4, 10, arrival=0.0), req("B", 4, 10, arrival=0.1)]})
    scheduled = [s[0] for s in steps]
    assert scheduled[:5] == [{"A": 4, "B": 4}] + [{"A": 1, "B": 1}] * 4
    # Step 5: both reach position 8 and need a third block; none is free: B (last) goes.
    assert scheduled[5] == {"A": 1} and steps[5][1] == {"B"}
    assert steps[5][3] == 1  # B's two blocks came back, A took one
    # B (9 tokens: prompt 4 + 5 outputs) needs 3 blocks; it waits until A finishes at step 9.
    assert scheduled[6:10] == [{"A": 1}] * 4 and steps[9][2] == ["A"]
    assert scheduled[10] == {"B": 9}  # recompute of prompt *and* outputs
    assert steps[14][2] == ["B"] and steps[-1][3] == 4


def test_preempted_request_goes_to_the_front_of_waiting():
    s = state_with(TIGHT, req("A", 4, 10, arrival=0.0), req("B", 4, 10, arrival=0.1))
    for _ in range(5):
        s, _, _ = step(s)
    s = add_request(s, req("C", 4, 10, arrival=5.0))
    s, out, _ = step(s)
    assert out.preempted_req_ids == {"B"}
    assert s.waiting == ("B", "C")  # the victim jumps ahead of the newer arrival
    b = s.requests["B"]
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert b.num_computed_tokens == 0 and len(b.output_token_ids) == 5
    assert s.block_table("B") == ()
    assert s.stats.num_preemptions == 1


def test_no_admissions_in_a_step_that_preempted():
    s = state_with(TIGHT, req("A", 4, 10, arrival=0.0), req("B", 4, 10, arrival=0.1))
    for _ in range(5):
        s, _, _ = step(s)
    s = add_request(s, req("C", 1, 1, arrival=5.0))  # 1 block would be free after preempting
    s, out, _ = step(s)
    assert out.preempted_req_ids == {"B"} and "C" not in out.num_scheduled_tokens
    assert s.num_free_blocks == 1  # C (1 block) would have fit
    s, out, _ = step(s)
    # Next step the WAITING pass runs, but B heads the queue and does not fit: the pass stops.
    assert s.waiting == ("B", "C") and "C" not in out.num_scheduled_tokens


def test_priority_a_request_that_preempts_itself_ends_the_running_pass():
    cfg = TIGHT.replace(policy="priority")
    _, steps = run(cfg, {0: [req("A", 4, 10, arrival=0.0, priority=1)],
                         1: [req("B", 4, 10, arrival=1.0, priority=0)]})
    scheduled = [s[0] for s in steps]
    assert scheduled[:5] == [{"A": 4}, {"A": 1, "B": 4}] + [{"A": 1, "B": 1}] * 3
    assert [s[3] for s in steps[:5]] == [3, 1, 0, 0, 0]
    # Step 5: A (first in `running`) needs a third block; the worst (priority, arrival) running
    # request is A itself, so A is preempted and the RUNNING pass stops there: B, which follows
    # A in `running` and whose next slot is already allocated, gets nothing this step (vLLM
    # breaks out of the loop), and nobody is admitted in a step that preempted.
    assert scheduled[5] == {} and steps[5][1] == {"A"} and steps[5][3] == 2
    # B decodes alone from step 6; A (9 tokens: 3 blocks) waits for B's blocks.
    assert scheduled[6:12] == [{"B": 1}] * 6 and steps[11][2] == ["B"]
    assert scheduled[12] == {"A": 9} and steps[16][2] == ["A"] and steps[-1][3] == 4


def test_fcfs_on_the_same_trace_preempts_the_newer_request_instead():
    _, steps = run(TIGHT, {0: [req("A", 4, 10, arrival=0.0, priority=1)],
                           1: [req("B", 4, 10, arrival=1.0, priority=0)]})
    assert steps[5][0] == {"A": 1} and steps[5][1] == {"B"}
    assert steps[10][0] == {"B": 8}  # prompt 4 + 4 outputs


def test_priority_victim_already_scheduled_gives_its_tokens_back():
    # High-priority A runs after low-priority B in `running` (B was admitted first); when A
    # needs a block, B (already scheduled this step) is preempted and its token returned.
    cfg = TIGHT.replace(policy="priority")
    s = state_with(cfg, req("B", 4, 10, arrival=0.0, priority=5))
    s, _, _ = step(s)
    s = add_request(s, req("A", 8, 10, arrival=1.0, priority=0))
    s, out, _ = step(s)
    assert dict(out.num_scheduled_tokens) == {"B": 1, "A": 8}
    while True:
        s, out, _ = step(s)
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids == {"B"}
    assert list(out.num_scheduled_tokens) == ["A"]
    assert out.total_num_scheduled_tokens == 1
