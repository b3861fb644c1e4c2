"""Automatic prefix caching: block ids, free-queue order, the hit cap, eviction, salts, counters."""

import dataclasses

import pytest

from scheduler import (
    SchedulerConfig,
    add_request,
    check_invariants,
    prefix_cache_hit,
    reset_prefix_cache,
)

from .util import req, state_with, step

CFG = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=32,
                      block_size=4, num_blocks=10)
PROMPT = tuple(range(1, 11))  # 10 tokens: two full blocks and a partial one


def test_free_queue_order_after_a_request_finishes():
    s = state_with(CFG, req("A", PROMPT, 1))
    assert s.free_block_queue() == tuple(range(1, 10))
    s, out, deltas = step(s)
    assert out.block_tables["A"] == (1, 2, 3)
    assert deltas[0].finish_reason == "length"
    # Freed tail first: block 3 (partial, uncached) to the head; 2 then 1 (cached) to the tail,
    # so the suffix is evicted before the prefix.
    assert s.free_block_queue() == (3, 4, 5, 6, 7, 8, 9, 2, 1)
    assert s.num_free_blocks == 9


def test_hit_reuses_the_cached_blocks_and_takes_them_off_the_free_queue():
    s = state_with(CFG, req("A", PROMPT, 1))
    s, _, _ = step(s)
    s = add_request(s, req("B", PROMPT, 2))
    s, out, _ = step(s)
    assert out.num_computed_tokens["B"] == 8 and out.num_scheduled_tokens["B"] == 2
    assert out.block_tables["B"] == (1, 2, 3)  # hits 1, 2; block 3 from the head
    assert s.free_block_queue() == (4, 5, 6, 7, 8, 9)
    assert s.stats.prefix_cache_queries == 20 and s.stats.prefix_cache_hits == 8


def test_hit_is_capped_at_num_tokens_minus_one():
    prompt = tuple(range(1, 9))  # exactly two blocks
    s = state_with(CFG, req("A", prompt, 1))
    s, _, _ = step(s)
    s = add_request(s, req("B", prompt, 1))
    s, out, _ = step(s)
    # The last token must be computed to get logits: only 1 of the 2 cached blocks is hit.
    assert out.num_computed_tokens["B"] == 4 and out.num_scheduled_tokens["B"] == 4


def test_reset_prefix_cache_forgets_every_block_and_keeps_the_rest():
    s = state_with(CFG, req("A", PROMPT, 1))
    s, _, _ = step(s)
    fresh = reset_prefix_cache(s)
    check_invariants(fresh)
    assert fresh.free_block_queue() == tuple(range(1, 10))  # the initial order, none cached
    assert fresh.step == s.step and fresh.counters == s.counters
    assert s.free_block_queue() == (3, 4, 5, 6, 7, 8, 9, 2, 1)  # the input state is unchanged
    fresh, out, _ = step(add_request(fresh, req("B", PROMPT, 2)))
    assert out.num_computed_tokens["B"] == 0 and out.num_scheduled_tokens["B"] == 10
    with pytest.raises(ValueError, match="1 requests are unfinished"):
        reset_prefix_cache(add_request(s, req("C", PROMPT, 2)))


def test_eviction_takes_the_least_recently_freed_suffix_first():
    cfg = CFG.replace(num_blocks=5)  # 4 usable blocks
    a = tuple(range(1, 9))
    s = state_with(cfg, req("A", a, 1))
    s, out, _ = step(s)
    assert out.block_tables["A"] == (1, 2) and s.free_block_queue() == (3, 4, 2, 1)
    s = add_request(s, req("C", tuple(range(100, 112)), 1))
    s, out, _ = step(s)
    assert out.block_tables["C"] == (3, 4, 2)  # block 2 (A's suffix) evicted, 1 kept
    assert s.free_block_queue() == (1, 2, 4, 3)
    s = add_request(s, req("D", a + (9,), 1))
    s, out, _ = step(s)
    assert out.num_computed_tokens["D"] == 4  # A's first block survived; its second did not
    assert out.block_tables["D"] == (1, 2, 4)
    assert s.free_block_queue() == (4, 3, 2, 1)


def test_cache_salt_separates_identical_prompts():
    s = state_with(CFG, req("A", PROMPT, 1, salt="tenant-1"))
    s, _, _ = step(s)
    s = add_request(s, req("B", PROMPT, 1, salt="tenant-2"))
    s, out, _ = step(s)
    assert out.num_computed_tokens["B"] == 0
    s = add_request(s, req("C", PROMPT, 1, salt="tenant-1"))
    s, out, _ = step(s)
    assert out.num_computed_tokens["C"] == 8


def test_blocks_are_registered_at_schedule_time():
    # B arrives while A's prompt is still being computed in the same step: A's blocks are
    # registered when scheduled, so B hits them without waiting for A to finish.
    s = state_with(CFG, req("A", PROMPT, 4), req("B", PROMPT, 4))
    s, out, _ = step(s)
    assert out.num_computed_tokens == {"A": 0, "B": 8}
    assert out.block_tables["B"][:2] == out.block_tables["A"][:2]
    assert out.block_tables["B"][2] != out.block_tables["A"][2]


def test_caching_off_never_hits():
    cfg = CFG.replace(enable_prefix_caching=False)
    s = state_with(cfg, req("A", PROMPT, 1))
    s, _, _ = step(s)
    assert s.free_block_queue() == (1, 2, 3, 4, 5, 6, 7, 8, 9)  # all uncached: back to the head
    s = add_request(s, req("B", PROMPT, 1))
    s, out, _ = step(s)
    assert out.num_computed_tokens["B"] == 0 and s.stats.prefix_cache_hits == 0


def test_preempted_request_hits_its_own_blocks_on_readmission():
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32,
                          block_size=4, num_blocks=5)
    s = state_with(cfg, req("A", 4, 10, arrival=0.0), req("B", 4, 10, arrival=0.1))
    while not (out := step(s))[1].preempted_req_ids:
        s = out[0]
    s = out[0]
    while "B" not in (res := step(s))[1].num_scheduled_tokens:
        s = res[0]
    plan = res[1]
    # B recomputes 9 tokens, but its first full blocks may still be cached: counted apart.
    assert plan.num_computed_tokens["B"] + plan.num_scheduled_tokens["B"] == 9
    stats = res[0].stats
    assert stats.preempted_prefix_cache_queries == 9
    assert stats.preempted_prefix_cache_hits == plan.num_computed_tokens["B"]


def test_block_hashes_chain_and_salt_only_the_first_block():
    from scheduler.kv.hashing import ROOT_HASH, extend_block_hashes, hash_block

    tokens = list(range(40))
    hashes = extend_block_hashes([], tokens, 2, 16, "s")
    assert hashes[0] == hash_block(ROOT_HASH, tokens[:16], "s")
    assert hashes[1] == hash_block(hashes[0], tokens[16:32])  # chained, unsalted
    assert extend_block_hashes(hashes[:1], tokens, 2, 16, "s") == hashes[1:]
    assert extend_block_hashes([], tokens, 1, 16, None)[0] != hashes[0]


def test_a_request_with_prompt_logprobs_skips_reading_the_cache_but_fills_it():
    # vLLM's skip_reading_prefix_cache: every prompt position is computed (it has logprobs),
    # no lookup is counted, and its own blocks still enter the cache for later requests.
    s = state_with(CFG, req("A", PROMPT, 1))
    s, _, _ = step(s)
    asked = req("B", PROMPT, 2, prompt_logprobs=1)
    assert asked.skip_reading_prefix_cache and not req("C", PROMPT, 1).skip_reading_prefix_cache
    assert prefix_cache_hit(s, asked) == 0 and prefix_cache_hit(s, req("C", PROMPT, 1)) == 8
    s = add_request(s, asked)
    s, out, _ = step(s)
    assert out.num_computed_tokens["B"] == 0 and out.num_scheduled_tokens["B"] == 10
    assert out.block_tables["B"] == (3, 4, 5)  # from the free head: not A's cached 1 and 2
    assert s.stats.prefix_cache_queries == 10 and s.stats.prefix_cache_hits == 0  # A's only
    s = add_request(s, req("C", PROMPT, 1))
    s, out, _ = step(s)
    assert out.num_computed_tokens["C"] == 8
    assert s.stats.prefix_cache_queries == 20 and s.stats.prefix_cache_hits == 8


def test_skip_reading_prefix_cache_can_be_set_either_way():
    assert req("A", PROMPT, 1, prompt_logprobs=0).skip_reading_prefix_cache
    forced = dataclasses.replace(req("A", PROMPT, 1), skip_reading_prefix_cache=True)
    s = state_with(CFG, req("X", PROMPT, 1))
    s, _, _ = step(s)
    s, out, _ = step(add_request(s, forced))
    assert out.num_computed_tokens["A"] == 0
    reading = dataclasses.replace(req("B", PROMPT, 1, prompt_logprobs=2),
                                  skip_reading_prefix_cache=False)
    s, out, _ = step(add_request(s, reading))
    assert out.num_computed_tokens["B"] == 8
