"""Prometheus collectors with vLLM's metric names (`vllm:` -> `jaxengine:`) and meanings.

Each logger owns its `CollectorRegistry` (never prometheus_client's global one), so several
servers, or several tests, can live in one process. Labels follow vLLM: `model_name` and
`engine` (always "0": one engine per server), plus `finished_reason` on `request_success`.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxengine.engine.stats import IterationStats
from scheduler import SchedulerStats

PREFIX = "jaxengine:"
FINISH_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason values
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class PrometheusStatLogger:
    """Records scheduler and iteration statistics into its own registry."""

    def __init__(self, model_name: str, max_model_len: int,
                 registry: CollectorRegistry | None = None) -> None:
        """Create every collector.

        Args:
          model_name: the served model name (the `model_name` label).
          max_model_len: bounds the token-count histogram buckets.
          registry: where to register; default a new `CollectorRegistry`.
        """
        self.registry = CollectorRegistry() if registry is None else registry
        self._labels = {"model_name": model_name, "engine": "0"}
        self._scheduler_collectors()
        self._token_collectors(build_1_2_5_buckets(max_model_len))
        self._latency_collectors()

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, list(self._labels),
                     registry=self.registry).labels(**self._labels)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(PREFIX + name, doc, list(self._labels),
                       registry=self.registry).labels(**self._labels)

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(PREFIX + name, doc, list(self._labels), buckets=buckets,
                         registry=self.registry).labels(**self._labels)

    def _scheduler_collectors(self) -> None:
        self.running = self._gauge("num_requests_running",
                                   "Number of requests in model execution batches.")
        self.waiting = self._gauge("num_requests_waiting",
                                   "Number of requests waiting to be processed.")
        self.kv_usage = self._gauge("kv_cache_usage_perc",
                                    "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = self._counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = self._counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = self._counter("num_preemptions",
                                         "Cumulative number of preemption from the engine.")

    def _token_collectors(self, token_buckets: Sequence[float]) -> None:
        self.prompt_tokens = self._counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = self._counter("generation_tokens",
                                               "Number of generation tokens processed.")
        self._success = Counter(PREFIX + "request_success",
                                "Count of successfully processed requests.",
                                [*self._labels, "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:  # every series exists from the start, at 0
            self._success.labels(**self._labels, finished_reason=reason)
        self.request_prompt_tokens = self._histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = self._histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets)
        self.request_max_tokens = self._histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            token_buckets)
        self.iteration_tokens = self._histogram(
            "iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            ITERATION_TOKEN_BUCKETS)

    def _latency_collectors(self) -> None:
        self.ttft = self._histogram("time_to_first_token_seconds",
                                    "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds",
                                   "Histogram of inter-token latency in seconds.",
                                   TOKEN_LATENCY_BUCKETS)
        self.tpot = self._histogram("request_time_per_output_token_seconds",
                                    "Histogram of time_per_output_token_seconds per request.",
                                    TOKEN_LATENCY_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds",
                                   "Histogram of e2e request latency in seconds.",
                                   REQUEST_LATENCY_BUCKETS)
        self.queue_time = self._histogram("request_queue_time_seconds",
                                          "Histogram of time spent in WAITING phase for request.",
                                          REQUEST_LATENCY_BUCKETS)

    def record(self, scheduler_stats: SchedulerStats,
               iteration_stats: IterationStats | None) -> None:
        """Take one step's statistics (the engine calls this; see `engine.stats.StatLogger`)."""
        self.record_scheduler(scheduler_stats)
        if iteration_stats is not None:
            self.record_iteration(iteration_stats)

    def record_scheduler(self, stats: SchedulerStats) -> None:
        """Set the gauges from a scheduler snapshot."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)

    def record_iteration(self, it: IterationStats) -> None:
        """Add one step's increments and observations."""
        self.prefix_queries.inc(it.prefix_cache_queries)
        self.prefix_hits.inc(it.prefix_cache_hits)
        self.preemptions.inc(it.num_preempted_reqs)
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        if it.num_tokens:
            self.iteration_tokens.observe(it.num_tokens)
        for t in it.time_to_first_tokens:
            self.ttft.observe(t)
        for t in it.inter_token_latencies:
            self.itl.observe(t)
        for f in it.finished_requests:
            self._success.labels(**self._labels, finished_reason=f.finish_reason).inc()
            self.e2e.observe(f.e2e_latency)
            self.queue_time.observe(f.queued_time)
            if f.mean_time_per_output_token is not None:
                self.tpot.observe(f.mean_time_per_output_token)
            self.request_prompt_tokens.observe(f.num_prompt_tokens)
            self.request_generation_tokens.observe(f.num_generation_tokens)
            if f.max_tokens_param:
                self.request_max_tokens.observe(f.max_tokens_param)

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
