"""Metrics over the fake-model engine: the engine's step statistics add up, Prometheus text,
the log line."""

from __future__ import annotations

import logging
import re

import pytest

from jaxengine.engine import step_outputs
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine.stats import IterationStats
from jaxengine.metrics import LoggingStatLogger, PrometheusStatLogger
from jaxengine.metrics.prometheus import build_1_2_5_buckets
from jaxengine.model.fake import fake_greedy
from scheduler import RequestDelta, SamplingParams, SchedulerStats, update_from_output
from tests.jaxengine.engine.test_llm_engine import PROMPTS, FakeTokenizer, V, make_engine

MAX_TOKENS = 6


class Kept:
    """A stat logger that keeps what the engine hands it."""

    def __init__(self) -> None:
        self.iterations: list[IterationStats] = []

    def record(self, scheduler_stats: SchedulerStats,
               iteration_stats: IterationStats | None) -> None:
        assert iteration_stats is not None
        self.iterations.append(iteration_stats)


def _loggers(engine: LLMEngine) -> tuple[Kept, PrometheusStatLogger, LoggingStatLogger]:
    kept = Kept()
    prom = PrometheusStatLogger("fake", engine.max_model_len)
    log = LoggingStatLogger(engine.snapshot().stats)
    engine.stat_loggers += [kept, prom, log]
    return kept, prom, log


def _run(engine, prompts, params):  # type: ignore[no-untyped-def]
    """Step to the end; the engine feeds a keeper, a Prometheus logger and a log-line logger."""
    kept, prom, log = _loggers(engine)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    steps = 0
    for _ in range(500):  # bounded: far more steps than the workload needs
        if not engine.has_unfinished_requests():
            break
        engine.step()
        steps += 1
    assert not engine.has_unfinished_requests()
    assert len(kept.iterations) == steps  # one IterationStats per step
    return kept.iterations, prom, log


def _value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_step_statistics_add_up_to_the_workload() -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    stats, prom, _ = _run(make_engine(), PROMPTS, params)
    assert sum(s.num_generation_tokens for s in stats) == MAX_TOKENS * len(PROMPTS)
    assert sum(s.num_prompt_tokens for s in stats) == sum(map(len, PROMPTS))
    assert sum(len(s.time_to_first_tokens) for s in stats) == len(PROMPTS)
    assert sum(len(s.inter_token_latencies) for s in stats) == (MAX_TOKENS - 1) * len(PROMPTS)
    finished = [f for s in stats for f in s.finished_requests]
    assert sorted(f.num_prompt_tokens for f in finished) == sorted(map(len, PROMPTS))
    assert {f.finish_reason for f in finished} == {"length"}
    assert all(f.max_tokens_param == MAX_TOKENS for f in finished)
    text = prom.render().decode()
    assert _value(text, "jaxengine:request_success_total", finished_reason="length") == len(
        PROMPTS)
    assert _value(text, "jaxengine:request_success_total", finished_reason="abort") == 0
    assert _value(text, "jaxengine:generation_tokens_total") == MAX_TOKENS * len(PROMPTS)
    # One observation per step that produced tokens (the async loop's first call collects
    # nothing yet).
    assert _value(text, "jaxengine:iteration_tokens_total_count") == sum(
        1 for s in stats if s.num_tokens)
    assert sum(1 for s in stats if not s.num_tokens) <= 1
    assert _value(text, "jaxengine:e2e_request_latency_seconds_count") == len(PROMPTS)
    assert _value(text, "jaxengine:num_requests_running") == 0
    assert _value(text, "jaxengine:kv_cache_usage_perc") == 0


def test_preemptions_and_prefix_hits_are_counted_once() -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine = make_engine(num_blocks=18)
    stats, prom, _ = _run(engine, PROMPTS, params)
    total = engine.snapshot().stats
    assert total.num_preemptions > 0
    assert sum(s.num_preempted_reqs for s in stats) == total.num_preemptions
    text = prom.render().decode()
    assert _value(text, "jaxengine:num_preemptions_total") == total.num_preemptions
    shared = list(range(50, 82))
    engine = make_engine(max_num_seqs=2)
    stats, prom, log = _run(engine, [shared + [i] for i in range(4)], params)
    total = engine.snapshot().stats
    assert total.prefix_cache_hits > 0
    text = prom.render().decode()
    assert _value(text, "jaxengine:prefix_cache_hits_total") == total.prefix_cache_hits
    assert _value(text, "jaxengine:prefix_cache_queries_total") == total.prefix_cache_queries
    rate = 100 * total.prefix_cache_hits / total.prefix_cache_queries
    assert f"Prefix cache hit rate: {rate:.1f}%" in log.log()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_aborted_requests_count_as_finished_abort(async_scheduling: bool) -> None:
    engine = make_engine(async_scheduling=async_scheduling)
    kept, prom, _ = _loggers(engine)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for rid, prompt in (("running", PROMPTS[0]), ("waiting", PROMPTS[1])):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    engine.abort_request("waiting")
    (waiting,) = kept.iterations[-1].finished_requests
    assert waiting.num_generation_tokens == 0 and waiting.queued_time == waiting.e2e_latency
    for _ in range(3):
        engine.step()
    engine.abort_request(["running", "unknown"])
    (running,) = kept.iterations[-1].finished_requests
    # Three steps ran; the async loop has taken in two of them (the third was in flight).
    drawn = 2 if async_scheduling else 3
    assert (running.finish_reason, running.num_generation_tokens) == ("abort", drawn)
    assert running.max_tokens_param == 50 and running.num_prompt_tokens == len(PROMPTS[0])
    assert engine.abort_request("running") == [] and len(kept.iterations) == 5  # nothing more
    text = prom.render().decode()
    assert _value(text, "jaxengine:request_success_total", finished_reason="abort") == 2
    assert _value(text, "jaxengine:request_success_total", finished_reason="length") == 0
    assert _value(text, "jaxengine:e2e_request_latency_seconds_count") == 2


def test_a_stop_string_is_the_schedulers_stop_and_counts_as_stop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    deltas: list[RequestDelta] = []

    def update_and_keep(*args, **kwargs):  # type: ignore[no-untyped-def]
        state, step_deltas = update_from_output(*args, **kwargs)
        deltas.extend(step_deltas)
        return state, step_deltas

    monkeypatch.setattr(step_outputs, "update_from_output", update_and_keep)
    engine = make_engine()
    kept, prom, _ = _loggers(engine)
    stop = FakeTokenizer().decode(fake_greedy(PROMPTS[0], 5, V)[3:5])  # spans two tokens
    engine.add_request("s", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop]))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        assert engine.snapshot().stats.num_running == int(engine.has_unfinished_requests())
    final = outputs[-1].outputs[0]
    assert (final.finish_reason, final.stop_reason, len(final.token_ids)) == ("stop", stop, 5)
    # the scheduler itself finished it as stopped, in the step that sampled the last token
    assert deltas[-1] == RequestDelta("s", (final.token_ids[-1],), "stop", stop)
    assert engine.snapshot().num_free_blocks == engine.scheduler_config.num_blocks - 1
    (finished,) = kept.iterations[-1].finished_requests
    assert finished.finish_reason == "stop" and finished.num_generation_tokens == 5
    text = prom.render().decode()
    assert _value(text, "jaxengine:request_success_total", finished_reason="stop") == 1
    assert _value(text, "jaxengine:request_success_total", finished_reason="abort") == 0


def test_each_logger_has_its_own_registry() -> None:
    a, b = PrometheusStatLogger("a", 64), PrometheusStatLogger("b", 64)  # no duplicate errors
    a.prompt_tokens[0].inc(5)
    assert _value(a.render().decode(), "jaxengine:prompt_tokens_total") == 5
    assert _value(b.render().decode(), "jaxengine:prompt_tokens_total") == 0
    assert 'model_name="b"' in b.render().decode()


def test_log_line_reports_throughput_and_is_quiet_when_idle(
        caplog: pytest.LogCaptureFixture) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    _, _, log = _run(make_engine(), PROMPTS[:2], params)
    with caplog.at_level(logging.DEBUG, logger="jaxengine.metrics"):
        start = log._interval_start
        busy = log.log(now=start + 2.0)  # a two-second interval
        log.log(now=start + 4.0)  # after a busy interval still INFO (the rate dropped to 0)
        idle = log.log(now=start + 6.0)
    assert busy.startswith(
        f"Avg prompt throughput: {sum(map(len, PROMPTS[:2])) / 2:.1f} tokens/s, "
        f"Avg generation throughput: {2 * MAX_TOKENS / 2:.1f} tokens/s, ")
    assert "Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%" in busy
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.INFO, logging.INFO, logging.DEBUG]
    assert idle.startswith("Avg prompt throughput: 0.0 tokens/s")


def test_token_buckets_are_1_2_5() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(128) == [1, 2, 5, 10, 20, 50, 100]
