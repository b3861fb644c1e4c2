"""Workload files (load, validate, save) and the generators."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxengine.lab.generators import (
    SCENARIOS,
    RequestClass,
    bursty_arrivals,
    generate_workload,
    poisson_arrivals,
    scenario,
)
from jaxengine.lab.workloads import WorkloadError, load_workload, parse_workload, save_workload

ROOT = Path(__file__).resolve().parents[3]


def test_mix64_loads_with_its_ids_and_defaults() -> None:
    w = load_workload(ROOT / "benchmarks" / "workloads" / "mix64.json")
    assert len(w.requests) == 64 and w.requests[0].request_id == "m00"
    assert all(r.arrival_time == 0.0 and r.priority == 0 for r in w.requests)
    assert w.info["name"] == "mix64"
    assert w.requests[0].prompt_class == "medium"


def test_save_then_load_round_trips(tmp_path: Path) -> None:
    w = scenario("srb_mix", num_requests=12, rate=5.0, seed=3, vocab_size=100, scale=0.1)
    save_workload(w, tmp_path / "w.json")
    again = load_workload(tmp_path / "w.json")
    assert again == w


@pytest.mark.parametrize(("request_", "needle"), [
    ({"max_tokens": 4}, "lacks 'prompt_token_ids'"),
    ({"prompt_token_ids": [], "max_tokens": 4}, "non-empty list"),
    ({"prompt_token_ids": [1, -2], "max_tokens": 4}, "integers >= 0"),
    ({"prompt_token_ids": [1], "max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"prompt_token_ids": [1], "max_tokens": 2, "arrival_time": -1}, "arrival_time"),
    ({"prompt_token_ids": [1], "max_tokens": 2, "arrival": 1.0}, "unknown field(s) ['arrival']"),
    ({"prompt_token_ids": [1], "max_tokens": 2, "priority": 1.5}, "priority must be an integer"),
    ({"prompt_token_ids": [1], "max_tokens": 2, "tenant": 3}, "tenant must be a string"),
])
def test_bad_requests_name_the_request_and_field(request_: dict, needle: str) -> None:
    with pytest.raises(WorkloadError, match="requests\\[1\\]") as info:
        parse_workload({"requests": [{"prompt_token_ids": [1], "max_tokens": 1}, request_]})
    assert needle in str(info.value)


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="does not exist"):
        load_workload(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(WorkloadError, match="not valid JSON"):
        load_workload(tmp_path / "bad.json")
    (tmp_path / "obj.json").write_text(json.dumps({"reqs": []}))
    with pytest.raises(WorkloadError, match="'requests' list"):
        load_workload(tmp_path / "obj.json")
    with pytest.raises(WorkloadError, match="more than once"):
        parse_workload([{"id": "a", "prompt_token_ids": [1], "max_tokens": 1}] * 2)
    with pytest.raises(WorkloadError, match="no requests"):
        parse_workload([])


def test_poisson_arrivals_have_the_rate_and_bursts_arrive_together() -> None:
    rng = np.random.default_rng(0)
    times = poisson_arrivals(4000, 20.0, rng)
    assert times[0] == 0.0 and times == sorted(times)
    assert 3500 / 20 < times[-1] < 4500 / 20  # mean gap 1/20 s
    bursts = bursty_arrivals(40, 20.0, 8, np.random.default_rng(1))
    assert len(set(bursts)) == 5 and all(bursts.count(t) == 8 for t in set(bursts))
    assert poisson_arrivals(3, float("inf"), rng) == [0.0, 0.0, 0.0]


def test_classes_share_prefixes_and_carry_priority_and_tenant() -> None:
    cls = RequestClass(name="a", weight=1.0, prompt_len=(20, 30), max_tokens=(2, 5),
                       priority=2, tenant="t", shared_prefix_len=10)
    w = generate_workload([cls], [0.0] * 10, rng=np.random.default_rng(0), vocab_size=50)
    assert len({r.prompt_token_ids[:10] for r in w.requests}) == 1
    assert len({r.prompt_token_ids for r in w.requests}) == 10
    assert all(20 <= len(r.prompt_token_ids) <= 30 and 2 <= r.max_tokens <= 5 for r in w.requests)
    assert all(r.priority == 2 and r.tenant == "t" and max(r.prompt_token_ids) < 50
               for r in w.requests)
    with pytest.raises(WorkloadError, match="shared_prefix_len"):
        RequestClass(name="b", weight=1, prompt_len=(5, 6), max_tokens=(1, 1),
                     shared_prefix_len=5)


def test_scenarios_are_seeded_and_srb_priorities_order_s_r_b() -> None:
    assert set(SCENARIOS) >= {"many_short", "long_prompt_short_output",
                              "short_prompt_long_output", "srb_mix", "tenants"}
    a = scenario("srb_mix", num_requests=200, rate=10.0, seed=7)
    assert a == scenario("srb_mix", num_requests=200, rate=10.0, seed=7)
    assert a != scenario("srb_mix", num_requests=200, rate=10.0, seed=8)
    by = {c: [r for r in a.requests if r.prompt_class == c] for c in "SRB"}
    assert all(by[c] for c in "SRB")
    assert [by[c][0].priority for c in "SRB"] == [0, 1, 2]
    mean = {c: np.mean([len(r.prompt_token_ids) for r in by[c]]) for c in "SRB"}
    assert mean["S"] < mean["R"] < mean["B"]
    long = scenario("long_prompt_short_output", num_requests=20, rate=1.0)
    assert all(len(r.prompt_token_ids) >= 512 and r.max_tokens <= 16 for r in long.requests)
    tenants = scenario("tenants", num_requests=100, rate=10.0)
    assert {r.tenant for r in tenants.requests} == {"a", "b"}
    with pytest.raises(WorkloadError, match="unknown scenario"):
        scenario("nope", num_requests=1, rate=1.0)
