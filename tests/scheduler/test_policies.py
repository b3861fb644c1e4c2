"""Policies are plug-ins: a research policy is added without touching schedule()."""

import importlib
import inspect

from scheduler import POLICIES, SchedulerConfig, SortedPolicy, register

from .util import req, run, state_with, step

CFG = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=1, max_model_len=16,
                      block_size=4, num_blocks=20, enable_prefix_caching=False)


def _admission_order(cfg, requests):
    _, steps = run(cfg, {0: requests})
    order = []
    for scheduled, *_ in steps:
        order += [r for r in scheduled if r not in order]
    return order


REQS = [req("long", 12, 1, arrival=0.0, priority=2), req("mid", 6, 1, arrival=0.1, priority=0),
        req("short", 2, 1, arrival=0.2, priority=1)]


def test_fcfs_admits_in_arrival_order():
    assert _admission_order(CFG, REQS) == ["long", "mid", "short"]


def test_priority_admits_lowest_priority_value_first():
    assert _admission_order(CFG.replace(policy="priority"), REQS) == ["mid", "short", "long"]


def test_shortest_remaining_prompt_first_research_policy():
    assert _admission_order(CFG.replace(policy="srpf"), REQS) == ["short", "mid", "long"]


def test_a_new_policy_plugs_in_without_touching_schedule():
    source_before = inspect.getsource(importlib.import_module("scheduler.schedule"))

    @register
    class LongestFirst(SortedPolicy):
        name = "test-longest-first"

        def sort_key(self, r):
            return (-len(r.prompt_token_ids), r.arrival_time, r.request_id)

    try:
        cfg = CFG.replace(policy="test-longest-first")
        assert _admission_order(cfg, REQS) == ["long", "mid", "short"]
        assert "test-longest-first" not in source_before
    finally:
        del POLICIES["test-longest-first"]


def test_priority_ties_break_by_arrival_then_id():
    cfg = CFG.replace(policy="priority")
    s = state_with(cfg, req("b", 2, 1, arrival=1.0), req("a", 2, 1, arrival=1.0),
                   req("c", 2, 1, arrival=0.5))
    assert s.waiting == ("c", "a", "b")
    s, out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["c"]
