"""The four shared examples of docs/SCHEDULING.md §7, via replay and via the API step by step."""

from scheduler import SchedulerConfig, add_request, init_state
from scheduler.replay import replay

from .util import req, step


def _trace(config: dict, requests: list[dict]) -> list[dict]:
    return list(replay({"config": config, "requests": requests, "sampled_token": 7}))


def _r(rid, prompt, max_tokens, arrival_step, **extra):
    tokens = prompt if isinstance(prompt, list) else list(range(100 + 50 * len(rid), 100 + 50 *
                                                                 len(rid) + prompt))
    return {"id": rid, "prompt_token_ids": tokens, "max_tokens": max_tokens,
            "arrival_step": arrival_step, **extra}


EXAMPLE_1 = [{"A": 3, "B": 3}, {"A": 1, "B": 1, "C": 6}, {"A": 1, "B": 1, "C": 4, "D": 2},
             {"A": 1, "B": 1, "C": 1, "D": 1}, {"A": 1, "B": 1, "C": 1, "D": 1},
             {"A": 1, "B": 1, "C": 1, "D": 1}, {"A": 1, "B": 1, "D": 1}, {"A": 1, "B": 1}]


def test_example_1_chunked_prefill_mixes_with_decode_replay():
    config = {"max_num_batched_tokens": 8, "max_num_seqs": 4, "num_blocks": 100,
              "block_size": 16, "max_model_len": 64}
    steps = _trace(config, [_r("A", 3, 8, 0), _r("B", 3, 8, 0), _r("C", 10, 4, 1),
                            _r("D", 3, 4, 1)])
    assert [s["num_scheduled_tokens"] for s in steps] == EXAMPLE_1
    assert [list(s["num_scheduled_tokens"]) for s in steps][2] == ["A", "B", "C", "D"]
    assert [sorted(s["finished"]) for s in steps][5:] == [["C"], ["D"], ["A", "B"]]
    assert steps[-1]["num_free_blocks"] == 99


def test_example_1_via_the_api():
    cfg = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, num_blocks=100,
                          max_model_len=64)
    s = init_state(cfg)
    s = add_request(s, req("A", 3, 8, arrival=0.0))
    s = add_request(s, req("B", 3, 8, arrival=0.1))
    s, out, _ = step(s)
    assert dict(out.num_scheduled_tokens) == {"A": 3, "B": 3}
    assert set(out.sampling_req_ids) == {"A", "B"}
    s = add_request(s, req("C", 10, 4, arrival=1.0))
    s = add_request(s, req("D", 3, 4, arrival=1.1))
    s, out, _ = step(s)
    assert dict(out.num_scheduled_tokens) == {"A": 1, "B": 1, "C": 6}
    assert out.sampling_req_ids == ("A", "B")  # C's 6-token chunk samples nothing
    assert s.requests["C"].num_computed_tokens == 6 and s.requests["C"].output_token_ids == ()
    s, out, _ = step(s)
    assert dict(out.num_scheduled_tokens) == {"A": 1, "B": 1, "C": 4, "D": 2}
    assert out.num_computed_tokens["C"] == 6 and out.input_token_ids["C"] == tuple(
        req("C", 10).prompt_token_ids[6:])
    finished = []
    for expected in EXAMPLE_1[3:]:
        s, out, deltas = step(s)
        assert dict(out.num_scheduled_tokens) == expected
        finished.append(sorted(d.request_id for d in deltas if d.finish_reason == "length"))
    assert finished == [[], [], ["C"], ["D"], ["A", "B"]]
    assert s.num_free_blocks == 99 and not s.requests


def test_example_2_sequence_limit_wastes_budget():
    config = {"max_num_batched_tokens": 8, "max_num_seqs": 3, "num_blocks": 100,
              "max_model_len": 64}
    steps = _trace(config, [_r(x, 2, 3, 0) for x in "ABCDE"])
    scheduled = [s["num_scheduled_tokens"] for s in steps]
    assert scheduled[0] == {"A": 2, "B": 2, "C": 2}  # D fits in the budget, not in the seqs
    assert scheduled[1] == scheduled[2] == {"A": 1, "B": 1, "C": 1}
    assert sorted(steps[2]["finished"]) == ["A", "B", "C"]
    assert scheduled[3] == {"D": 2, "E": 2}


def test_example_3_no_chunking_blocks_the_head_of_the_line():
    config = {"max_num_batched_tokens": 8, "max_num_seqs": 4, "num_blocks": 100,
              "max_model_len": 8, "enable_chunked_prefill": False}
    steps = _trace(config, [_r("A", 3, 4, 0), _r("B", 3, 4, 0), _r("C", 7, 1, 1)])
    scheduled = [s["num_scheduled_tokens"] for s in steps]
    assert scheduled[:5] == [{"A": 3, "B": 3}, {"A": 1, "B": 1}, {"A": 1, "B": 1},
                             {"A": 1, "B": 1}, {"C": 7}]
    assert sorted(steps[3]["finished"]) == ["A", "B"]
    assert steps[4]["finished"] == ["C"]


def test_example_4_prefix_hit_shrinks_the_prefill():
    shared = list(range(1, 1001))
    config = {"max_num_batched_tokens": 512, "num_blocks": 200, "block_size": 16,
              "enable_prefix_caching": True}
    a = _r("A", shared + list(range(5000, 5020)), 4, 0)
    b = _r("B", shared + list(range(6000, 6020)), 4, 2)
    steps = _trace(config, [a, b])
    scheduled = [s["num_scheduled_tokens"] for s in steps]
    assert scheduled[:3] == [{"A": 512}, {"A": 508}, {"A": 1, "B": 28}]  # B hit 992 tokens
    assert steps[-1]["num_free_blocks"] == 199


def test_example_4_counts_the_hit():
    shared = tuple(range(1, 1001))
    cfg = SchedulerConfig(max_num_batched_tokens=512, num_blocks=200, block_size=16)
    s = add_request(init_state(cfg), req("A", shared + tuple(range(5000, 5020)), 4))
    s, _, _ = step(s)
    s, _, _ = step(s)
    s = add_request(s, req("B", shared + tuple(range(6000, 6020)), 4, arrival=2.0))
    s, out, _ = step(s)
    assert out.num_computed_tokens["B"] == 992
    assert out.scheduled_new_reqs[0].num_computed_tokens == 992
    assert out.block_tables["B"][:62] == out.block_tables["A"][:62]  # shared prefix blocks
    assert s.stats.prefix_cache_queries == 1020 + 1020
    assert s.stats.prefix_cache_hits == 992


def test_example_2_via_the_api():
    cfg = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=3, num_blocks=100,
                          max_model_len=64)
    s = init_state(cfg)
    for i, rid in enumerate("ABCDE"):
        s = add_request(s, req(rid, 2, 3, arrival=i * 0.1))
    s, out, _ = step(s)
    assert dict(out.num_scheduled_tokens) == {"A": 2, "B": 2, "C": 2}
    assert out.total_num_scheduled_tokens == 6 and s.waiting == ("D", "E")
    for _ in range(2):
        s, out, deltas = step(s)
        assert dict(out.num_scheduled_tokens) == {"A": 1, "B": 1, "C": 1}
    assert sorted(d.request_id for d in deltas if d.finish_reason) == ["A", "B", "C"]
    s, out, _ = step(s)
    assert dict(out.num_scheduled_tokens) == {"D": 2, "E": 2}


def test_example_3_via_the_api():
    cfg = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, num_blocks=100,
                          max_model_len=8, enable_chunked_prefill=False)
    s = init_state(cfg)
    s = add_request(s, req("A", 3, 4, arrival=0.0))
    s = add_request(s, req("B", 3, 4, arrival=0.1))
    s, out, _ = step(s)
    s = add_request(s, req("C", 7, 1, arrival=1.0))
    for _ in range(3):
        s, out, _ = step(s)
        assert dict(out.num_scheduled_tokens) == {"A": 1, "B": 1}  # 6 left, C needs 7
        assert s.waiting == ("C",)
    s, out, deltas = step(s)
    assert dict(out.num_scheduled_tokens) == {"C": 7}
    assert deltas[0].finish_reason == "length" and not s.requests
