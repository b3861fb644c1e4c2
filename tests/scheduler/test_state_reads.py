"""`SchedulerState`'s read API: its columns as they are, agreeing with the `Request`s built from
them, read-only, and what `check_invariants` reads."""

import dataclasses
from types import MappingProxyType

import pytest

from scheduler import (
    SchedulerConfig,
    SchedulerState,
    check_invariants,
    schedule,
    update_from_output,
)

from .util import req, state_with, step

# 6 usable blocks of 4 tokens: three requests outgrow the pool, so one is preempted.
CFG = SchedulerConfig(
    max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32, block_size=4, num_blocks=7
)
SHARED = tuple(range(1, 9))  # two full blocks every request starts with: prefix-cache hits


def _check_reads_agree(s: SchedulerState) -> None:
    for rid, r in s.requests.items():
        assert rid in s.requests
        assert s.status(rid) == r.status
        assert s.spec_token_ids(rid) == r.spec_token_ids
        assert s.num_computed_tokens[rid] == r.num_computed_tokens
        assert s.num_output_placeholders.get(rid, 0) == r.num_output_placeholders
        assert s.block_tables.get(rid, ()) == s.block_table(rid)
        assert s.read_data(lambda d, rid=rid: tuple(d.tokens[rid])) == r.all_token_ids
    assert set(s.num_computed_tokens) == set(s.requests)
    assert set(s.num_cached_blocks) == set(s.block_tables)
    assert "unknown" not in s.requests


def test_the_columns_agree_with_the_requests_built_from_them_under_async_scheduling():
    s = state_with(
        CFG.replace(async_scheduling=True),
        *(
            req(r, SHARED + (10 * i + 1, 10 * i + 2), 8, arrival=0.1 * i)
            for i, r in enumerate("ABC")
        ),
    )
    s, in_flight = schedule(s)
    owed = cached = preempted = 0
    while s.requests:
        s, plan = schedule(s)  # the next plan while `in_flight` runs: its tokens are owed
        check_invariants(s, plan)
        _check_reads_agree(s)
        owed += sum(s.num_output_placeholders.values())
        cached += sum(s.num_cached_blocks.values())
        preempted += len(plan.preempted_req_ids)
        sampled = {rid: [7] for rid in in_flight.sampling_req_ids}
        s, _ = update_from_output(s, in_flight, sampled)
        check_invariants(s)
        _check_reads_agree(s)
        in_flight = plan
    assert owed and cached and preempted  # each column was read while it held something


def test_drafts_are_read_as_the_request_holds_them():
    s, plan, _ = step(state_with(CFG, req("A", 6, 8)))
    s, plan = schedule(s)
    s, _ = update_from_output(s, plan, {"A": [7]}, draft_token_ids={"A": [8, 9]})
    assert s.spec_token_ids("A") == (8, 9) == s.requests["A"].spec_token_ids
    _check_reads_agree(s)


def test_the_columns_are_the_states_own_read_only_mappings():
    s, _, _ = step(state_with(CFG, req("A", 6, 4)))
    assert s.block_tables is s.block_tables  # handed out, not copied
    assert s.num_computed_tokens is s.num_computed_tokens
    with pytest.raises(TypeError):
        s.block_tables["A"] = ()  # type: ignore[index]
    with pytest.raises(TypeError):
        s.num_computed_tokens["A"] = 0  # type: ignore[index]


def test_invariants_read_the_columns_a_broken_state_holds():
    s, _, _ = step(state_with(CFG, req("A", 6, 4)))
    check_invariants(s)
    with pytest.raises(AssertionError, match="running A holds no block table"):
        check_invariants(
            dataclasses.replace(s, _tables=MappingProxyType({}), _num_cached=MappingProxyType({}))
        )
    with pytest.raises(AssertionError, match="A: computed past its tokens"):
        check_invariants(dataclasses.replace(s, _computed=MappingProxyType({"A": 100})))
