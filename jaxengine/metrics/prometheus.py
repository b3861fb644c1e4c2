"""Prometheus collectors with vLLM's metric names (`vllm:` -> `jaxengine:`) and meanings.

Each logger owns its `CollectorRegistry` (never prometheus_client's global one), so several
servers, or several tests, can live in one process. Labels follow vLLM: `model_name` and
`engine` (the data-parallel replica: "0" .. "M-1"; "0" alone without data parallelism), plus
`finished_reason` on `request_success`. Every series of every replica exists from the start,
so summing over `engine` gives the totals. `cache_config_info` is vLLM's info gauge: value 1,
labelled with the KV cache's configuration and `engine` only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from jaxengine.engine.stats import FinishedRequestStats, IterationStats
from jaxengine.spec.metrics import SpecDecodingProm
from scheduler import SchedulerStats

if TYPE_CHECKING:
    from jaxengine.engine.llm_engine import LLMEngine

PREFIX = "jaxengine:"
LABELS = ("model_name", "engine")  # of every collector (vLLM's)
FINISH_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason values
TRANSFER_TYPES = ("GPU_to_CPU", "CPU_to_GPU")  # vLLM's kv_offload labels: save, load
KV_OFFLOAD_SIZE_BUCKETS = [1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6]  # bytes
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
    """Records scheduler and iteration statistics into its own registry, per engine replica.

    Each collector attribute maps an engine index to that replica's series (vLLM's
    `make_per_engine`); `record(..., engine_idx=i)` writes replica i's.
    """

    def __init__(self, model_name: str, max_model_len: int,
                 registry: CollectorRegistry | None = None,
                 engine_indexes: Sequence[int] = (0,)) -> None:
        """Create every collector, with a series for each engine index.

        Args:
          model_name: the served model name (the `model_name` label).
          max_model_len: bounds the token-count histogram buckets.
          registry: where to register; default a new `CollectorRegistry`.
          engine_indexes: the data-parallel replicas recorded (the `engine` label).
        """
        self.registry = CollectorRegistry() if registry is None else registry
        self.engine_indexes = tuple(engine_indexes)
        if not self.engine_indexes:
            raise ValueError("PrometheusStatLogger needs at least one engine index")
        self._model_name = model_name
        self._scheduler_collectors()
        self._token_collectors(build_1_2_5_buckets(max_model_len))
        self._latency_collectors()
        self.spec_decoding: SpecDecodingProm | None = None  # made by the first drafts verified
        self._kv_offload_collectors()

    def _per_engine[M: MetricWrapperBase](self, family: M) -> dict[int, M]:
        return {i: family.labels(model_name=self._model_name, engine=str(i))
                for i in self.engine_indexes}

    def _gauge(self, name: str, doc: str) -> dict[int, Gauge]:
        return self._per_engine(Gauge(PREFIX + name, doc, LABELS, registry=self.registry))

    def _counter(self, name: str, doc: str) -> dict[int, Counter]:
        return self._per_engine(Counter(PREFIX + name, doc, LABELS, registry=self.registry))

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]
                   ) -> dict[int, Histogram]:
        return self._per_engine(Histogram(PREFIX + name, doc, LABELS, buckets=buckets,
                                          registry=self.registry))

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
        success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                          [*LABELS, "finished_reason"], registry=self.registry)
        self._success = {  # every series exists from the start, at 0
            (i, reason): success.labels(model_name=self._model_name, engine=str(i),
                                        finished_reason=reason)
            for i in self.engine_indexes for reason in FINISH_REASONS}
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

    def _kv_offload_collectors(self) -> None:
        """KV connector hits (vLLM's external prefix cache) and host offloading transfers."""
        self.external_queries = self._counter(
            "external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in "
            "terms of number of queried tokens.")
        self.external_hits = self._counter(
            "external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in "
            "terms of number of cached tokens.")
        self.kv_offload_usage = self._gauge(
            "kv_offload_usage_perc", "KV offloading host store usage. 1 means 100 percent usage.")
        labels = [*LABELS, "transfer_type"]
        families = (
            Counter(PREFIX + "kv_offload_total_bytes", "Number of bytes offloaded by KV "
                    "connector", labels, registry=self.registry),
            Counter(PREFIX + "kv_offload_total_time", "Total time measured by all KV "
                    "offloading operations", labels, registry=self.registry),
            Histogram(PREFIX + "kv_offload_size", "Histogram of KV offload transfer size, in "
                      "bytes.", labels, buckets=KV_OFFLOAD_SIZE_BUCKETS, registry=self.registry))
        self._kv_bytes, self._kv_time, self._kv_size = (
            {(i, t): family.labels(model_name=self._model_name, engine=str(i), transfer_type=t)
             for i in self.engine_indexes for t in TRANSFER_TYPES}
            for family in families)

    def log_cache_config(self, infos: Mapping[int, Mapping[str, str]]) -> None:
        """vLLM's `cache_config_info` gauge: for each engine index i of `infos`, one series of
        value 1 labelled with `infos[i]` (`cache_config_info` of replica i) and `engine`."""
        unknown = sorted(set(infos) - set(self.engine_indexes))
        if unknown:
            raise ValueError(f"cache configs of engines {unknown}, but this logger records "
                             f"engines {list(self.engine_indexes)}")
        labels = [*next(iter(infos.values())), "engine"]
        gauge = Gauge(PREFIX + "cache_config_info", "Information of the LLMEngine CacheConfig",
                      labels, registry=self.registry)
        for i, info in infos.items():
            gauge.labels(**info, engine=str(i)).set(1)

    def record(self, scheduler_stats: SchedulerStats,
               iteration_stats: IterationStats | None, engine_idx: int = 0) -> None:
        """Take one step's statistics of replica `engine_idx` (see `engine.stats.StatLogger`;
        `jaxengine.metrics.EngineStatLogger` binds the index for a replica's engine)."""
        self.record_scheduler(scheduler_stats, engine_idx)
        if iteration_stats is not None:
            self.record_iteration(iteration_stats, engine_idx)

    def record_scheduler(self, stats: SchedulerStats, engine_idx: int = 0) -> None:
        """Set replica `engine_idx`'s gauges from its scheduler snapshot."""
        self.running[engine_idx].set(stats.num_running)
        self.waiting[engine_idx].set(stats.num_waiting)
        self.kv_usage[engine_idx].set(stats.kv_cache_usage)

    def record_iteration(self, it: IterationStats, engine_idx: int = 0) -> None:
        """Add one step's increments and observations to replica `engine_idx`'s series."""
        e = engine_idx
        self.prefix_queries[e].inc(it.prefix_cache_queries)
        self.prefix_hits[e].inc(it.prefix_cache_hits)
        self.preemptions[e].inc(it.num_preempted_reqs)
        self.external_queries[e].inc(it.connector_prefix_cache_queries)
        self.external_hits[e].inc(it.connector_prefix_cache_hits)
        if it.kv_offload_usage is not None:
            self.kv_offload_usage[e].set(it.kv_offload_usage)
        for t in it.kv_offload_transfers:
            self._kv_bytes[e, t.transfer_type].inc(t.num_bytes)
            self._kv_time[e, t.transfer_type].inc(t.seconds)
            self._kv_size[e, t.transfer_type].observe(t.num_bytes)
        self.prompt_tokens[e].inc(it.num_prompt_tokens)
        self.generation_tokens[e].inc(it.num_generation_tokens)
        if it.spec_decoding is not None:
            if self.spec_decoding is None:
                self.spec_decoding = SpecDecodingProm(
                    self.registry, PREFIX, LABELS, self._model_name, self.engine_indexes,
                    it.spec_decoding.num_spec_tokens)
            self.spec_decoding.observe(it.spec_decoding, e)
        if it.num_tokens:
            self.iteration_tokens[e].observe(it.num_tokens)
        for t in it.time_to_first_tokens:
            self.ttft[e].observe(t)
        for t in it.inter_token_latencies:
            self.itl[e].observe(t)
        for f in it.finished_requests:
            self._record_finished(f, e)

    def _record_finished(self, f: FinishedRequestStats, e: int) -> None:
        self._success[e, f.finish_reason].inc()
        self.e2e[e].observe(f.e2e_latency)
        self.queue_time[e].observe(f.queued_time)
        if f.mean_time_per_output_token is not None:
            self.tpot[e].observe(f.mean_time_per_output_token)
        self.request_prompt_tokens[e].observe(f.num_prompt_tokens)
        self.request_generation_tokens[e].observe(f.num_generation_tokens)
        if f.max_tokens_param:
            self.request_max_tokens[e].observe(f.max_tokens_param)

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)


def cache_config_info(engine: LLMEngine) -> dict[str, str]:
    """The labels of `cache_config_info` for `engine` (a replica): vLLM's `CacheConfig` fields
    that this engine has, each as `str(value)` as vLLM writes them. `cache_dtype` is the
    `kv_cache_dtype` argument as given ("auto", "fp8", ...), `num_gpu_blocks` the pool's
    blocks (the null block included), `num_cpu_blocks` the KV offloading store's (0: off)."""
    args, config = engine.args, engine.config
    offload = engine.kv_offload
    info = {
        "block_size": config.scheduler.block_size,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "cache_dtype": args.kv_cache_dtype,
        "num_gpu_blocks_override": args.num_gpu_blocks_override,
        "enable_prefix_caching": config.scheduler.enable_prefix_caching,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "kv_offloading_size": args.kv_offloading_size,
        "num_gpu_blocks": config.scheduler.num_blocks,
        "num_cpu_blocks": 0 if offload is None else offload.store.capacity_pages,
    }
    return {name: str(value) for name, value in info.items()}
