"""`prefix_cache_hit`: the hit admission would give, in exact tokens, and nothing changes."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Request, SchedulerConfig, add_request, prefix_cache_hit, schedule

from .util import req, state_with, step

CFG = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=32,
                      block_size=4, num_blocks=10)
PROMPT = tuple(range(1, 11))  # 10 tokens: two full blocks and a partial one


def _cached_a(cfg: SchedulerConfig = CFG, salt: str | None = None):  # type: ignore[no-untyped-def]
    """A state whose prefix cache holds A's two full blocks (A still running)."""
    s, _, _ = step(state_with(cfg, req("A", PROMPT, 4, salt=salt)))
    return s


def test_hits_are_whole_blocks_of_the_shared_prefix() -> None:
    s = _cached_a()
    assert prefix_cache_hit(s, req("B", PROMPT + (99, 98), 1)) == 8
    assert prefix_cache_hit(s, req("B", PROMPT[:8] + (50, 51, 52), 1)) == 8
    assert prefix_cache_hit(s, req("B", PROMPT[:7] + (50, 51, 52), 1)) == 4  # block 2 differs
    assert prefix_cache_hit(s, req("B", PROMPT[:3] + (50,) * 8, 1)) == 0  # block 1 differs
    assert prefix_cache_hit(s, req("B", (0,) + PROMPT, 1)) == 0


def test_the_last_token_is_never_a_hit() -> None:
    s = _cached_a()
    assert prefix_cache_hit(s, req("B", PROMPT, 1)) == 8  # 10 tokens: 2 blocks may hit
    assert prefix_cache_hit(s, req("B", PROMPT[:9], 1)) == 8
    assert prefix_cache_hit(s, req("B", PROMPT[:8], 1)) == 4  # exactly 2 blocks: 1 may hit
    assert prefix_cache_hit(s, req("B", PROMPT[:4], 1)) == 0


def test_the_salt_separates_caches() -> None:
    s = _cached_a(salt="tenant-1")
    assert prefix_cache_hit(s, req("B", PROMPT, 1, salt="tenant-1")) == 8
    assert prefix_cache_hit(s, req("B", PROMPT, 1, salt="tenant-2")) == 0
    assert prefix_cache_hit(s, req("B", PROMPT, 1)) == 0


def test_outputs_a_request_arrives_with_count() -> None:
    s = _cached_a()
    b = Request(request_id="B", prompt_token_ids=PROMPT[:5], output_token_ids=PROMPT[5:9])
    assert prefix_cache_hit(s, b) == 8  # 9 tokens in all


def test_nothing_is_cached_before_a_step_or_without_caching() -> None:
    s = state_with(CFG, req("A", PROMPT, 4))  # waiting: no block registered yet
    assert prefix_cache_hit(s, req("B", PROMPT, 1)) == 0
    off = _cached_a(CFG.replace(enable_prefix_caching=False))
    assert prefix_cache_hit(off, req("B", PROMPT, 1)) == 0


def test_the_query_agrees_with_admission_and_changes_nothing() -> None:
    s = _cached_a()
    twin = _cached_a()
    memo = s.read_data(lambda d: dict(d.kv.req_hashes))
    b = req("B", PROMPT[:8] + (60, 61), 1, arrival=1.0)
    assert prefix_cache_hit(s, b) == 8
    assert s == twin and s.counters == twin.counters  # state, pool and cache as they were
    assert s.read_data(lambda d: dict(d.kv.req_hashes)) == memo  # no hashes memoized
    _, plan = schedule(add_request(s, b))
    assert plan.num_computed_tokens["B"] == 8


def test_an_older_state_answers_from_its_own_cache() -> None:
    empty = state_with(CFG, req("A", PROMPT, 4))
    cached, _, _ = step(empty)
    b = req("B", PROMPT, 1)
    assert (prefix_cache_hit(empty, b), prefix_cache_hit(cached, b)) == (0, 8)
    assert prefix_cache_hit(empty, b) == 0  # read again after the newer one was read


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 2, 4]))
def test_the_query_is_the_hit_of_the_next_admission(seed: int, block_size: int) -> None:
    # Random prompts over a tiny alphabet share prefixes often; each step admits at most the
    # queried request (max_num_seqs=1 and finishing after one token keep the queue short).
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=1, max_model_len=32,
                          block_size=block_size, num_blocks=40)
    s = state_with(cfg)
    for i in range(8):
        prompt = tuple(rng.choice((1, 2)) for _ in range(rng.randint(1, 12)))
        r = req(f"r{i}", prompt, 1, arrival=float(i))
        predicted = prefix_cache_hit(s, r)
        s, plan, _ = step(add_request(s, r))
        assert plan.num_computed_tokens[r.request_id] == predicted
