"""Concurrent partial prefill limits (docs/SCHEDULING.md §6)."""

from scheduler import SchedulerConfig

from .util import req, run

CFG = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64,
                      block_size=4, num_blocks=60, max_num_partial_prefills=2,
                      max_long_partial_prefills=1, long_prefill_token_threshold=20)


def test_long_prefills_are_limited_and_short_ones_start_beside_them():
    _, steps = run(CFG, {0: [req("A", 40, 2, arrival=0.0), req("B", 40, 2, arrival=0.1),
                             req("C", 6, 4, arrival=0.2)]})
    scheduled = [s[0] for s in steps]
    # Step 0: two prefills can run (A long, C short; B long is over the long limit and is
    # skipped without losing its place), so each gets at most 32 // 2 = 16 tokens.
    assert scheduled[0] == {"A": 16, "C": 6}
    # Step 1: A is the only schedulable prefill: its slot is the whole budget, the threshold
    # caps it at 20; B is still over the long limit.
    assert scheduled[1] == {"A": 20, "C": 1}
    # Step 2: A's last 4 tokens are no longer "long", so B may start, in a 16-token slot.
    assert scheduled[2] == {"A": 4, "C": 1, "B": 16}
    assert scheduled[3] == {"A": 1, "C": 1, "B": 20}
    assert steps[-1][3] == 59


def test_at_most_p_partial_prefills_per_step():
    cfg = CFG.replace(max_long_partial_prefills=2, long_prefill_token_threshold=64,
                      max_num_batched_tokens=60)
    _, steps = run(cfg, {0: [req(x, 30, 1, arrival=i) for i, x in enumerate("ABC")]})
    assert steps[0][0] == {"A": 30, "B": 30}  # C waits: P = 2 prefills are running
    assert steps[1][0] == {"C": 30}


def test_off_by_default_a_single_prefill_takes_the_whole_budget():
    cfg = CFG.replace(max_num_partial_prefills=1, max_long_partial_prefills=1,
                      long_prefill_token_threshold=0)
    _, steps = run(cfg, {0: [req("A", 40, 2, arrival=0.0), req("B", 40, 2, arrival=0.1)]})
    assert steps[0][0] == {"A": 32}
