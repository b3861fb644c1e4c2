"""Step records of hand-checked scheduler runs, and the figures drawn from them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from matplotlib.collections import PathCollection

from jaxengine.engine.args import EngineArgs
from jaxengine.lab.plots import (
    LatencySamples,
    ParetoPoint,
    latency_cdfs,
    pareto_front,
    pareto_indices,
    timeline,
)
from jaxengine.lab.timeline import EngineTimeline, StepRecord, step_record
from jaxengine.model.fake import fake_greedy, fake_model
from scheduler import (
    Request,
    SamplingParams,
    SchedulerConfig,
    add_request,
    init_state,
    schedule,
    update_from_output,
)
from tests.engine_helpers import engine_over

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _req(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(request_id=rid, prompt_token_ids=tuple(prompt),
                   sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _run(config: SchedulerConfig, arrivals: dict[int, list[Request]]) -> list[StepRecord]:
    """Drive the scheduler by hand (every sampler samples token 7); a record per step, the
    clock advancing 0.5 s per step."""
    state, records = init_state(config), []
    while len(records) <= max(arrivals) or state.requests:
        for r in arrivals.get(len(records), ()):
            state = add_request(state, r)
        after, plan = schedule(state)
        records.append(step_record(state, after, plan, time_s=0.5 * len(records)))
        state, _ = update_from_output(after, plan, {r: [7] for r in plan.sampling_req_ids})
    return records


def _chunked_run() -> list[StepRecord]:
    """docs/SCHEDULING.md §7 example 1: budget 8; C's 10-token prompt is split over three
    steps while A and B decode; D's 3-token prompt over two."""
    cfg = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64,
                          num_blocks=100)
    return _run(cfg, {0: [_req("A", [1, 2, 3], 8), _req("B", [4, 5, 6], 8)],
                      1: [_req("C", list(range(10, 20)), 4), _req("D", [7, 8, 9], 4)]})


def _preempting_run() -> list[StepRecord]:
    """Four usable blocks of 4 tokens, two 4-token prompts generating 10 each: at step 5 A
    needs a third block and B (admitted last) is preempted; it recomputes after A ends."""
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32,
                          block_size=4, num_blocks=5, enable_prefix_caching=False)
    return _run(cfg, {0: [_req("A", [1, 2, 3, 4], 10), _req("B", [5, 6, 7, 8], 10)]})


def test_chunked_prefill_then_decodes() -> None:
    recs = _chunked_run()
    # step 0: A, B prompts; 1: A, B decode + C 6; 2: + C 4, D 2 (budget); 3: D's last prompt
    # token is prefill, C's first decode is not (its 10 prompt tokens are computed).
    assert [(r.decode_tokens, r.prefill_tokens) for r in recs[:5]] == [
        (0, 6), (2, 6), (2, 6), (3, 1), (4, 0)]
    assert [(r.num_running, r.num_waiting) for r in recs[:3]] == [(2, 0), (3, 1), (4, 0)]
    # one 16-token block per request, of 99 usable
    assert [r.kv_cache_usage for r in recs[:3]] == [2 / 99, 3 / 99, 4 / 99]
    assert [r.step for r in recs] == list(range(len(recs)))
    assert [r.time_s for r in recs[:3]] == [0.0, 0.5, 1.0]
    # every prompt token is computed once; each output but the last is decoded once
    assert sum(r.prefill_tokens for r in recs) == 3 + 3 + 10 + 3
    assert sum(r.decode_tokens for r in recs) == 7 + 7 + 3 + 3
    assert all(r.num_preempted == 0 and r.prefix_hit_tokens == 0 for r in recs)


def test_preemption_and_recompute() -> None:
    recs = _preempting_run()
    assert [r.num_preempted for r in recs] == [0] * 5 + [1] + [0] * 9
    assert [r.kv_cache_usage for r in recs] == (
        [0.5] + [1.0] * 4 + [0.75] * 4 + [1.0] + [0.75] * 4 + [1.0])
    assert (recs[5].decode_tokens, recs[5].num_running, recs[5].num_waiting) == (1, 1, 1)
    # B recomputes its prompt and five outputs as a prefill, then decodes
    assert (recs[10].decode_tokens, recs[10].prefill_tokens) == (0, 9)
    assert [r.decode_tokens for r in recs[11:]] == [1] * 4


def test_prefix_hit() -> None:
    shared = list(range(1, 33))  # two full 16-token blocks
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=128,
                          block_size=16, num_blocks=9)
    recs = _run(cfg, {0: [_req("A", shared + [900, 901], 2)],
                      3: [_req("B", shared + [800, 801, 802, 803], 2)]})
    assert [(r.prefill_tokens, r.decode_tokens, r.prefix_hit_tokens) for r in recs] == [
        (34, 0, 0), (0, 1, 0), (0, 0, 0), (4, 0, 32), (0, 1, 0)]
    assert [r.kv_cache_usage for r in recs] == [3 / 8, 3 / 8, 0.0, 3 / 8, 3 / 8]


def test_step_record_needs_a_schedule_result() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, num_blocks=10)
    state = add_request(init_state(cfg), _req("A", [1, 2, 3], 2))
    after, plan = schedule(state)
    with pytest.raises(ValueError, match="before.step"):
        step_record(after, after, plan, time_s=0.0)


def test_timeline_figure_draws_the_records(tmp_path) -> None:
    recs = _preempting_run()
    path = tmp_path / "timeline.png"
    fig = timeline(recs, title="preemption", save=path)
    assert path.read_bytes().startswith(PNG_MAGIC)
    ax_tok, ax_kv, ax_q = fig.axes
    decode, prefill = (p.get_data() for p in ax_tok.patches)  # two stairs
    assert decode.values.tolist() == [r.decode_tokens for r in recs]
    assert decode.baseline == 0
    assert (prefill.values - prefill.baseline).tolist() == [r.prefill_tokens for r in recs]
    assert prefill.baseline.tolist() == [r.decode_tokens for r in recs]  # stacked
    assert decode.edges.tolist() == [s - 0.5 for s in range(len(recs) + 1)]
    (preempts,) = [c for c in ax_tok.collections if isinstance(c, PathCollection)]
    assert preempts.get_offsets()[:, 0].tolist() == [5.0]  # one marker, at step 5
    assert preempts.get_label() == "preemption (1)"
    (kv,) = ax_kv.get_lines()
    assert list(kv.get_ydata()) == [r.kv_cache_usage for r in recs]
    running, waiting = ax_q.get_lines()
    assert list(waiting.get_ydata()) == [r.num_waiting for r in recs]


def test_timeline_marks_prefix_hits_and_takes_dicts_on_a_time_axis() -> None:
    recs = [StepRecord(step=0, time_s=0.0, decode_tokens=0, prefill_tokens=34,
                       kv_cache_usage=0.4, num_preempted=0, prefix_hit_tokens=0,
                       num_running=1, num_waiting=0),
            StepRecord(step=1, time_s=0.25, decode_tokens=1, prefill_tokens=4,
                       kv_cache_usage=0.5, num_preempted=0, prefix_hit_tokens=32,
                       num_running=2, num_waiting=0)]
    # as the simulator keeps them: dicts with one more key
    fig = timeline([{**dataclasses.asdict(r), "seconds": 0.25} for r in recs], x="time")
    ax_tok = fig.axes[0]
    assert ax_tok.patches[0].get_data().edges.tolist() == [0.0, 0.25, 0.5]
    (hits,) = ax_tok.collections
    assert hits.get_label() == "prefix hit (32 tokens)"
    assert hits.get_offsets()[:, 0].tolist() == pytest.approx([0.375])  # the bar's middle
    assert ax_tok.get_xlabel() == "" and fig.axes[2].get_xlabel() == "time (s)"


def test_timeline_rejects_bad_input() -> None:
    rec = _chunked_run()[0]
    with pytest.raises(ValueError, match="at least one"):
        timeline([])
    with pytest.raises(ValueError, match="'step' or 'time'"):
        timeline([rec], x="seconds")
    with pytest.raises(ValueError, match="increasing step"):
        timeline([rec, rec])
    late = dataclasses.replace(rec, step=1, time_s=rec.time_s - 1.0)
    with pytest.raises(ValueError, match="increasing time"):
        timeline([rec, late], x="time")
    with pytest.raises(ValueError, match=r"missing \['time_s'\]"):
        timeline([{k: v for k, v in dataclasses.asdict(rec).items() if k != "time_s"}])


def test_latency_cdfs_one_curve_per_run(tmp_path) -> None:
    runs = {"fcfs": LatencySamples(ttft_s=[0.3, 0.1, 0.2, 0.4], tpot_s=[0.02, 0.01]),
            "priority": {"ttft_s": [0.5, 0.05]}}  # no TPOT samples: no TPOT curve
    path = tmp_path / "cdf.png"
    fig = latency_cdfs(runs, save=path)
    assert path.stat().st_size > 0 and path.read_bytes().startswith(PNG_MAGIC)
    ax_ttft, ax_tpot = fig.axes
    fcfs, prio = ax_ttft.get_lines()
    assert (fcfs.get_label(), prio.get_label()) == ("fcfs", "priority")
    assert list(fcfs.get_xdata()) == [0.1, 0.2, 0.3, 0.4]
    assert list(fcfs.get_ydata()) == [0.25, 0.5, 0.75, 1.0]
    assert [line.get_label() for line in ax_tpot.get_lines()] == ["fcfs"]
    with pytest.raises(ValueError, match="tpot_s"):
        latency_cdfs({"x": {"ttft": [0.1]}})


def test_latency_samples_of_request_results() -> None:
    class Result:  # what jaxengine.lab.results.RequestResult carries
        def __init__(self, ttft: float | None, tpot: float | None) -> None:
            self.ttft, self.tpot = ttft, tpot

    samples = LatencySamples.of([Result(0.1, 0.02), Result(0.3, None), Result(None, None)])
    assert samples == LatencySamples(ttft_s=[0.1, 0.3], tpot_s=[0.02])


POINTS = [ParetoPoint(label="seqs=8", throughput=100.0, latency_s=0.2),
          ParetoPoint(label="seqs=16", throughput=180.0, latency_s=0.4),
          ParetoPoint(label="seqs=32", throughput=250.0, latency_s=0.9),
          ParetoPoint(label="slow", throughput=150.0, latency_s=0.8),  # dominated by seqs=16
          ParetoPoint(label="seqs=64", throughput=260.0, latency_s=2.0)]


def test_pareto_indices() -> None:
    assert pareto_indices(POINTS) == [0, 1, 2, 4]
    twins = [POINTS[0], dataclasses.replace(POINTS[0], label="twin")]
    assert pareto_indices(twins) == [0, 1]


def test_pareto_front_figure(tmp_path) -> None:
    path = tmp_path / "pareto.png"
    fig = pareto_front(POINTS, slo_s={"interactive": 0.5, "batch": 1.0},
                       recommended="seqs=32", save=path)
    assert path.read_bytes().startswith(PNG_MAGIC)
    (ax,) = fig.axes
    front, *slos = ax.get_lines()
    assert list(front.get_xdata()) == [0.2, 0.4, 0.9, 2.0]
    assert list(front.get_ydata()) == [100.0, 180.0, 250.0, 260.0]
    assert [line.get_xdata()[0] for line in slos] == [0.5, 1.0]
    assert [line.get_label() for line in slos] == ["interactive (0.5 s)", "batch (1 s)"]
    everything, star = ax.collections
    assert len(everything.get_offsets()) == len(POINTS)
    assert star.get_offsets().tolist() == [[0.9, 250.0]]
    assert star.get_label() == "recommended: seqs=32"


def test_pareto_front_joins_and_labels_the_points_it_is_given() -> None:
    fig = pareto_front(POINTS, front=["slow", "seqs=8"], annotate=["seqs=64"])
    (ax,) = fig.axes
    (front,) = ax.get_lines()
    assert list(front.get_xdata()) == [0.2, 0.8]  # by latency, not the Pareto-optimal ones
    assert [t.get_text() for t in ax.texts] == ["seqs=64"]
    assert not pareto_front(POINTS, front=[]).axes[0].get_lines()
    with pytest.raises(ValueError, match=r"annotate=\['nope'\] is not a point label"):
        pareto_front(POINTS, annotate=["nope"])


def test_pareto_front_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="not a point label"):
        pareto_front(POINTS, recommended="seqs=128")
    with pytest.raises(ValueError, match="unique"):
        pareto_front([POINTS[0], POINTS[0]])
    with pytest.raises(ValueError, match="at least one"):
        pareto_front([])
    fig = pareto_front([{"label": "a", "throughput": 1.0, "latency_s": 0.1}], slo_s=0.5)
    assert [line.get_label() for line in fig.axes[0].get_lines()] == [
        "Pareto front", "SLO (0.5 s)"]


def test_figures_do_not_accumulate_in_pyplot() -> None:
    import matplotlib.pyplot as plt

    before = len(plt.get_fignums())
    latency_cdfs({"a": LatencySamples(ttft_s=np.linspace(0.1, 1.0, 10))})
    assert len(plt.get_fignums()) == before


def test_engine_timeline_records_a_real_engine_run() -> None:
    engine = engine_over(fake_model(97), EngineArgs(max_num_batched_tokens=16, max_num_seqs=4,
                                                    block_size=4),
                         tokenizer=None, max_model_len=64, num_blocks=40)
    prompts = [list(range(1, 21)), [5, 6, 7], list(range(30, 39))]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    recorder, done, steps = EngineTimeline(engine), {}, 0
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in recorder.step() if o.finished)
        steps += 1
    assert [list(done[f"r{i}"].outputs[0].token_ids) for i in range(3)] == [
        fake_greedy(p, 5, 97) for p in prompts]  # recording changed nothing
    recs = recorder.records
    assert [r.step for r in recs] == list(range(steps))
    assert sum(r.prefill_tokens for r in recs) == 20 + 3 + 9
    assert sum(r.decode_tokens for r in recs) == 3 * 4
    assert recs[0].prefill_tokens == 16 and recs[0].num_waiting == 2  # the budget, r0 first
    times = [r.time_s for r in recs]
    assert times == sorted(times) and times[0] >= 0.0
