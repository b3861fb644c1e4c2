"""Metrics per data-parallel replica, and read back as values: `LLM.get_metrics()` in vLLM's
shape (`vllm.v1.metrics.reader`), summed over replicas."""

from __future__ import annotations

import pytest

from jaxengine.engine.stats import FinishedRequestStats, IterationStats
from jaxengine.llm import LLM
from jaxengine.metrics import (
    Counter,
    Gauge,
    Histogram,
    LoggingStatLogger,
    Metric,
    PrometheusStatLogger,
    aggregate_engines,
    get_metrics_snapshot,
)
from jaxengine.replicas.data_parallel import DataParallelEngine
from scheduler import SamplingParams, SchedulerStats
from tests.jaxengine.engine.test_llm_engine import PROMPTS, make_engine
from tests.jaxengine.metrics.test_metrics import _value

MAX_TOKENS = 5
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _finished(reason: str, e2e: float) -> FinishedRequestStats:
    return FinishedRequestStats(finish_reason=reason, num_prompt_tokens=3,
                                num_generation_tokens=2, e2e_latency=e2e, queued_time=0.0,
                                mean_time_per_output_token=None, max_tokens_param=None)


def _find(metrics: list[Metric], name: str, **labels: str) -> Metric:
    (m,) = [m for m in metrics if m.name == name and labels.items() <= m.labels.items()]
    return m


def _number(metrics: list[Metric], name: str, **labels: str) -> float:
    m = _find(metrics, name, **labels)
    assert isinstance(m, Counter | Gauge), m
    return m.value


def _two_engine_logger() -> PrometheusStatLogger:
    prom = PrometheusStatLogger("m", 64, engine_indexes=(0, 1))
    prom.record(SchedulerStats(num_running=2, kv_cache_usage=0.5),
                IterationStats(timestamp=0.0, num_generation_tokens=3,
                               finished_requests=[_finished("length", 0.4)]), engine_idx=0)
    prom.record(SchedulerStats(num_running=1, kv_cache_usage=0.25),
                IterationStats(timestamp=0.0, num_generation_tokens=4,
                               finished_requests=[_finished("length", 3.0),
                                                  _finished("abort", 0.4)]), engine_idx=1)
    return prom


def test_each_replica_has_its_own_series_and_they_sum() -> None:
    text = _two_engine_logger().render().decode()
    assert _value(text, "jaxengine:generation_tokens_total", engine="0") == 3
    assert _value(text, "jaxengine:generation_tokens_total", engine="1") == 4
    assert _value(text, "jaxengine:generation_tokens_total") == 7
    assert _value(text, "jaxengine:request_success_total", engine="1",
                  finished_reason="abort") == 1
    assert _value(text, "jaxengine:request_success_total", engine="0",
                  finished_reason="abort") == 0  # every series exists from the start
    assert _value(text, "jaxengine:num_requests_running", engine="0", model_name="m") == 2


def test_the_snapshot_is_one_value_per_series_in_vllms_shape() -> None:
    metrics = get_metrics_snapshot(_two_engine_logger().registry)
    tokens = _find(metrics, "jaxengine:generation_tokens", engine="1")
    assert tokens == Counter(name="jaxengine:generation_tokens",
                             labels={"model_name": "m", "engine": "1"}, value=4)
    running = _find(metrics, "jaxengine:num_requests_running", engine="0")
    assert isinstance(running, Gauge) and running.value == 2
    e2e = _find(metrics, "jaxengine:e2e_request_latency_seconds", engine="1")
    assert isinstance(e2e, Histogram) and (e2e.count, e2e.sum) == (2, 3.4)
    assert (e2e.buckets["0.3"], e2e.buckets["0.5"], e2e.buckets["2.5"], e2e.buckets["5.0"],
            e2e.buckets["+Inf"]) == (0, 1, 1, 2, 2)  # cumulative, as Prometheus keeps them
    assert len([m for m in metrics if m.name == "jaxengine:request_success"]) == 2 * 3


def test_aggregating_sums_replicas_and_averages_the_usage() -> None:
    metrics = aggregate_engines(get_metrics_snapshot(_two_engine_logger().registry))
    assert all("engine" not in m.labels for m in metrics)
    assert _number(metrics, "jaxengine:generation_tokens") == 7
    assert _number(metrics, "jaxengine:num_requests_running") == 3
    assert _number(metrics, "jaxengine:kv_cache_usage_perc") == 0.375
    assert _number(metrics, "jaxengine:request_success", finished_reason="length") == 2
    e2e = _find(metrics, "jaxengine:e2e_request_latency_seconds")
    assert isinstance(e2e, Histogram) and (e2e.count, e2e.buckets["0.5"]) == (3, 2)
    assert e2e.sum == pytest.approx(3.8)
    with pytest.raises(TypeError, match="share a name"):
        aggregate_engines([Counter(name="x", labels={"engine": "0"}, value=1),
                           Gauge(name="x", labels={"engine": "1"}, value=1.0)])


@pytest.mark.parametrize("replicas", [1, 2])
def test_llm_get_metrics_counts_the_workload(replicas: int) -> None:
    engines = [make_engine() for _ in range(replicas)]
    llm = LLM.from_engine(engines[0] if replicas == 1 else DataParallelEngine(engines))
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    metrics = llm.get_metrics()
    assert all("engine" not in m.labels for m in metrics)
    # vLLM's info gauge is labelled with the cache's configuration, every other with the model
    assert all(m.labels.get("model_name") == "default" for m in metrics
               if m.name != "jaxengine:cache_config_info")
    assert {type(m) for m in metrics} == {Counter, Gauge, Histogram}
    n = len(PROMPTS)
    assert _number(metrics, "jaxengine:generation_tokens") == MAX_TOKENS * n
    assert _number(metrics, "jaxengine:prompt_tokens") == sum(map(len, PROMPTS))
    assert _number(metrics, "jaxengine:request_success", finished_reason="length") == n
    queries = sum(e.snapshot().counters.prefix_cache_queries for e in engines)
    assert _number(metrics, "jaxengine:prefix_cache_queries") == queries
    ttft = _find(metrics, "jaxengine:time_to_first_token_seconds")
    assert isinstance(ttft, Histogram) and ttft.count == ttft.buckets["+Inf"] == n
    assert _number(metrics, "jaxengine:num_requests_running") == 0


def test_llm_get_metrics_reads_the_gauges_now() -> None:
    dp = DataParallelEngine([make_engine(), make_engine()])
    llm = LLM.from_engine(dp)
    for i, prompt in enumerate(PROMPTS[:3]):  # replicas 0, 1, 0
        dp.add_request(str(i), {"prompt_token_ids": prompt}, PARAMS)
    metrics = llm.get_metrics()  # before any step: all three wait
    assert _number(metrics, "jaxengine:num_requests_waiting") == 3
    dp.step()
    metrics = llm.get_metrics()
    usage = [r.snapshot().stats.kv_cache_usage for r in dp.replicas]
    assert min(usage) > 0
    assert _number(metrics, "jaxengine:num_requests_running") == 3
    assert _number(metrics, "jaxengine:kv_cache_usage_perc") == pytest.approx(
        sum(usage) / 2)


def test_the_log_line_sums_the_replicas() -> None:
    log = LoggingStatLogger(engine_indexes=(0, 1))
    log.record(SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.5),
               IterationStats(timestamp=0.0, num_generation_tokens=6), engine_idx=0)
    log.record(SchedulerStats(num_running=3, kv_cache_usage=0.1),
               IterationStats(timestamp=0.0, num_generation_tokens=4), engine_idx=1)
    line = log.log(now=log._interval_start + 2.0)
    assert "Avg generation throughput: 5.0 tokens/s" in line
    assert "Running: 5 reqs, Waiting: 1 reqs, GPU KV cache usage: 30.0%" in line
    with pytest.raises(ValueError, match="engine_idx 2 is not one of this logger's"):
        log.record(SchedulerStats(), engine_idx=2)
