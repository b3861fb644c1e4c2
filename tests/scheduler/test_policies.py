"""Policies are plug-ins: a research policy is added without touching schedule()."""

import dataclasses
import gc
import importlib
import inspect
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from scheduler import (
    POLICIES,
    Request,
    RequestStatus,
    SamplingParams,
    SchedulerConfig,
    SortedPolicy,
    add_request,
    register,
    resolve_policy,
    unregister,
)
from scheduler.core._work import Work

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
    source_before = inspect.getsource(importlib.import_module("scheduler.core.schedule"))

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


def test_a_taken_name_is_refused_unless_replaced_on_purpose_and_never_a_built_in_one():
    class Fake(SortedPolicy):
        name = "fcfs"

        def sort_key(self, r):
            return (r.request_id,)

    for replace in (False, True):  # a built-in policy can never be replaced
        with pytest.raises(ValueError, match="'fcfs' is a built-in policy's .*another name"):
            register(Fake, replace=replace)
    assert type(POLICIES["fcfs"]).__module__ == "scheduler.policies.policies"
    with pytest.raises(ValueError, match="built in and cannot be unregistered"):
        unregister("fcfs")

    def cell():  # a notebook cell defining the same policy, run twice: two distinct classes
        class Mine(SortedPolicy):
            name = "test-mine"

            def sort_key(self, r):
                return (r.arrival_time,)
        return Mine

    first, again = cell(), cell()
    assert register(first) is first and register(first) is first  # the same class: a no-op
    try:
        with pytest.raises(ValueError, match=r"'test-mine' is already registered \(Mine from "
                                             r"tests.scheduler.test_policies\); give Mine "
                                             r"another name, .*register\(replace=True\) or "
                                             r"unregister\('test-mine'\)"):
            register(again)
        assert type(POLICIES["test-mine"]) is first
        assert register(replace=True)(again) is again and type(POLICIES["test-mine"]) is again
    finally:
        unregister("test-mine")
    assert "test-mine" not in POLICIES
    with pytest.raises(ValueError, match="no policy named 'test-mine'"):
        unregister("test-mine")
    with pytest.raises(ValueError, match="subclass of scheduler.Policy"):
        register(SimpleNamespace)
    with pytest.raises(ValueError, match="needs a `name`"):
        register(type("Nameless", (SortedPolicy,), {}))


def test_resolve_policy_imports_module_colon_class(tmp_path: Path, monkeypatch):
    (tmp_path / "lab_decorated.py").write_text(
        "from scheduler import SortedPolicy, register\n"
        "@register\nclass Sjf(SortedPolicy):\n    name = 'test-sjf'\n"
        "    def sort_key(self, r): return (r.num_prompt_tokens, r.arrival_time)\n")
    (tmp_path / "lab_plain.py").write_text(
        "from scheduler import SortedPolicy\nNOT_A_POLICY = 3\n"
        "class Ljf(SortedPolicy):\n    name = 'test-ljf'\n"
        "    def sort_key(self, r): return (-r.num_prompt_tokens, r.arrival_time)\n")
    (tmp_path / "lab_broken.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert resolve_policy("fcfs") == "fcfs"
        assert resolve_policy("lab_decorated:Sjf") == "test-sjf"  # it registered itself
        assert resolve_policy("lab_decorated:test-sjf") == "test-sjf"  # by registered name
        assert resolve_policy("lab_plain:Ljf") == "test-ljf"  # registered now
        assert resolve_policy("lab_plain:Ljf") == "test-ljf"  # again: the same class
        assert _admission_order(CFG.replace(policy="test-sjf"), REQS) == ["short", "mid", "long"]
        for spec, needle in (
                ("lifo", "unknown scheduling policy 'lifo'; known: .*MODULE:CLASS"),
                ("lab_missing:X", "module 'lab_missing' does not import .ModuleNotFoundError"),
                ("lab_broken:X", "module 'lab_broken' does not import .RuntimeError: boom"),
                ("lab_plain:NOT_A_POLICY", "lab_plain.NOT_A_POLICY is a int, not a subclass"),
                ("lab_plain:Nope", "lab_plain.Nope is missing"),
                ("lab_plain:", "expected MODULE:CLASS")):
            with pytest.raises(ValueError, match=needle):
                resolve_policy(spec)
    finally:
        for name in ("test-sjf", "test-ljf"):
            POLICIES.pop(name, None)
        for module in ("lab_decorated", "lab_plain", "lab_broken"):
            sys.modules.pop(module, None)


def test_priority_ties_break_by_arrival_then_id():
    cfg = CFG.replace(policy="priority")
    s = state_with(cfg, req("b", 2, 1, arrival=1.0), req("a", 2, 1, arrival=1.0),
                   req("c", 2, 1, arrival=0.5))
    assert s.waiting == ("c", "a", "b")
    s, out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["c"]


# ---- progress-aware policies (docs/SCHEDULING.md §8) -----------------------------------------

SMALL = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=2, max_model_len=32,
                        block_size=4, num_blocks=6, enable_prefix_caching=False)


def _steps(s, n, arrivals=None):
    """n steps; `arrivals` maps a step index to requests added before it. Returns the state
    and the plan of every step."""
    plans = []
    for i in range(n):
        for r in (arrivals or {}).get(i, ()):
            s = add_request(s, r)
        s, out, _ = step(s)
        plans.append(out)
    return s, plans


def test_srpf_counts_the_prefix_cache_hit_and_resorts_as_the_cache_fills():
    cfg = SMALL.replace(policy="srpf", num_blocks=40, enable_prefix_caching=True)
    warm = req("warm", 8, 1)  # its two full blocks stay cached after it finishes
    a = req("a", list(warm.prompt_token_ids) + list(range(500, 506)), 1)  # 14 tokens, 8 cached
    s = state_with(cfg, req("busy", 2, 10), warm, req("b", 10, 1), a)
    # Cold cache: left to compute is the whole prompt: busy 2, warm 8, b 10, a 14.
    assert s.waiting == ("busy", "warm", "b", "a")
    s, out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["busy", "warm"]  # two seats
    assert s.waiting == ("b", "a")  # as sorted when warm was not cached yet
    views = {rid: _view(s, rid) for rid in ("a", "b")}
    assert views["a"].num_cached_tokens == 8 and views["a"].num_tokens_to_compute == 6
    assert views["b"].num_cached_tokens == 0 and views["b"].num_tokens_to_compute == 10
    s, out, _ = step(s)  # warm finished: a (6 left) now goes before b (10 left)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a"]
    assert out.num_scheduled_tokens["a"] == 6 and out.num_computed_tokens["a"] == 8


def test_srpf_makes_a_resumed_request_count_the_outputs_it_recomputes():
    cfg = SMALL.replace(policy="srpf", num_blocks=7)
    s = state_with(cfg, req("first", 4, 20), req("r", 8, 20))
    s, plans = _steps(s, 6, {3: [req("n", 10, 2)]})
    # Step 5: the pool is short; srpf's victim is the last admitted, r, with 8 + 5 tokens.
    assert plans[5].preempted_req_ids == {"r"}
    assert _view(s, "r").num_tokens_to_compute == 13 and _view(s, "r").num_prompt_tokens == 8
    assert s.waiting == ("n", "r")  # 10 < 13, though r's prompt (8) is shorter than n's
    s, out, _ = step(s)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["n"]


def _las_run(policy):
    s = state_with(SMALL.replace(policy=policy), req("old", 4, 20, arrival=0.0))
    return _steps(s, 9, {2: [req("young", 4, 20, arrival=2.0)],
                         4: [req("new", 4, 2, arrival=4.0)]})


def test_las_preempts_the_most_served_and_puts_it_behind_new_requests():
    s, plans = _las_run("las")
    # Step 7: old has 7 outputs, young 5; the pool is short, so old (most served) goes.
    assert plans[7].preempted_req_ids == {"old"}
    assert _view(s, "old").num_output_tokens == 7
    assert s.waiting == ("old",) and s.running == ("young", "new")
    assert [r.req_id for r in plans[8].scheduled_new_reqs] == ["new"]  # 0 served < old's 7


def test_fcfs_in_the_same_run_preempts_the_youngest_and_resumes_it_first():
    s, plans = _las_run("fcfs")
    assert plans[7].preempted_req_ids == {"young"}
    assert s.waiting == ("young", "new")


def _view(s, rid):
    """What a policy would see of `rid` at state `s` (read from a working copy, then undone)."""
    w = Work(s)
    try:
        v = w.views[rid]
        return SimpleNamespace(**{name: getattr(v, name) for name in _VIEW_FIELDS})
    finally:
        w.abort()


_VIEW_FIELDS = ("request_id", "num_prompt_tokens", "num_tokens", "num_output_tokens",
                "output_token_ids", "num_computed_tokens", "num_cached_tokens",
                "num_tokens_to_compute", "num_preemptions", "arrival_time", "priority",
                "num_served_tokens", "metadata", "status")


def test_a_view_shows_progress_and_metadata():
    r = Request(request_id="x", prompt_token_ids=tuple(range(1, 11)), arrival_time=1.5,
                priority=2, sampling_params=SamplingParams(max_tokens=8),
                metadata={"tenant": "a"})
    s = state_with(SMALL.replace(max_num_batched_tokens=6, long_prefill_token_threshold=0), r)
    s, _, _ = step(s)  # 6 of 10 prompt tokens
    v = _view(s, "x")
    assert (v.status, v.num_computed_tokens, v.num_output_tokens, v.num_tokens_to_compute) == (
        RequestStatus.RUNNING, 6, 0, 4)
    s, _, _ = step(s, sampler=9)  # the rest of the prompt, and a first token
    v = _view(s, "x")
    assert (v.num_tokens, v.num_output_tokens, v.output_token_ids, v.num_tokens_to_compute) == (
        11, 1, (9,), 1)
    assert (v.request_id, v.num_prompt_tokens, v.arrival_time, v.priority, v.num_preemptions,
            v.metadata, v.num_cached_tokens) == ("x", 10, 1.5, 2, 0, {"tenant": "a"}, 0)


def test_static_policies_are_never_reordered_dynamic_ones_before_every_step():
    calls = []

    class Reversing(SortedPolicy):
        def sort_key(self, r):
            return (r.arrival_time, r.request_id)

        def reorder(self, waiting, requests):
            calls.append(self.name)
            waiting.reverse()

    @register
    class StaticReversing(Reversing):
        name = "test-static"

    @register
    class DynamicReversing(Reversing):
        name = "test-dynamic"
        dynamic = True

    try:
        reqs = [req("a", 4, 1, arrival=0.0), req("b", 4, 1, arrival=1.0)]
        for name, first in (("test-static", "a"), ("test-dynamic", "b")):
            s = state_with(CFG.replace(policy=name), *reqs)
            assert s.waiting == ("a", "b")  # enqueue sorts either way
            s, out, _ = step(s)
            assert list(out.num_scheduled_tokens) == [first]
        assert calls == ["test-dynamic"]
    finally:
        del POLICIES["test-static"], POLICIES["test-dynamic"]


@pytest.mark.parametrize("policy", ["fcfs", "priority", "srpf", "las", "fair"])
def test_steps_leave_no_cyclic_garbage(policy):
    # Host time: a reference cycle (say a Work holding its views) would leave every step's
    # columns to the garbage collector, whose passes then cost more than the step itself.
    cfg = SMALL.replace(policy=policy, num_blocks=7, enable_prefix_caching=True)
    s = state_with(cfg, req("first", 4, 20), req("r", 8, 20), req("n", 10, 3))
    gc.collect()
    gc.disable()
    try:
        s, plans = _steps(s, 12)
        assert any(p.preempted_req_ids for p in plans)  # the victim path ran too
        assert gc.collect() == 0
    finally:
        gc.enable()


def _of(tenant, r):
    return dataclasses.replace(r, metadata={"tenant": tenant})


def test_fair_serves_the_tenant_with_least_service_first_finished_requests_included():
    reqs = [_of("A", req("a1", 8, 1, arrival=0.0)), _of("A", req("a2", 2, 1, arrival=0.1)),
            _of("B", req("b1", 2, 1, arrival=0.2)), req("n", 2, 1, arrival=0.3)]
    assert _admission_order(CFG, reqs) == ["a1", "a2", "b1", "n"]
    s = state_with(CFG.replace(policy="fair"), *reqs)
    s, out, _ = step(s)  # tags: a1 0, b1 0, n 0 (no tenant), a2 8 (a1's prompt ahead of it)
    assert list(out.num_scheduled_tokens) == ["a1"] and s.waiting == ("b1", "n", "a2")
    assert dict(s.finished_served) == {"A": 9}  # a1 finished: 8 prompt + 1 output tokens
    assert _admission_order(CFG.replace(policy="fair"), reqs) == ["a1", "b1", "n", "a2"]


def test_fair_interleaves_tenants_within_one_step():
    cfg = CFG.replace(policy="fair", max_num_seqs=2, max_num_batched_tokens=32)
    reqs = [_of("A", req(f"a{i}", 4, 1, arrival=0.1 * i)) for i in range(3)] + [
        _of("B", req(f"b{i}", 4, 1, arrival=1 + 0.1 * i)) for i in range(2)]
    s, out, _ = step(state_with(cfg, *reqs))
    assert list(out.num_scheduled_tokens) == ["a0", "b0"]  # tags a0 0, b0 0, a1 4, b1 4, a2 8
    assert s.waiting == ("a1", "b1", "a2")


def test_fair_preempts_the_most_served_tenant_and_resumes_it_after_a_new_tenant():
    s = state_with(SMALL.replace(policy="fair"), _of("A", req("old", 4, 20, arrival=0.0)))
    s, plans = _steps(s, 9, {2: [_of("B", req("young", 4, 20, arrival=2.0))],
                             4: [_of("C", req("new", 4, 2, arrival=4.0))]})
    # Step 7: A was served 4 + 7 tokens, B 4 + 5: A's request goes (fcfs would take young).
    assert plans[7].preempted_req_ids == {"old"}
    assert _view(s, "old").num_served_tokens == 11  # kept while it waits to recompute
    assert [r.req_id for r in plans[8].scheduled_new_reqs] == ["new"]  # C: 0 < A: 11
