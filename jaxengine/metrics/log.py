"""vLLM's periodic throughput log line, computed from the same statistics as Prometheus.

With data-parallel replicas one line covers them all (vLLM's aggregated logger): throughputs
and queue sizes are sums over the replicas, KV usage their mean (replicas have like pools).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from jaxengine.engine.stats import IterationStats
from jaxengine.spec.metrics import SpecDecodingLogging
from scheduler import SchedulerStats

logger = logging.getLogger("jaxengine.metrics")


class LoggingStatLogger:
    """Accumulates token counts between `log()` calls and logs throughput and queue sizes."""

    def __init__(self, stats: SchedulerStats | None = None, *,
                 engine_indexes: Sequence[int] = (0,)) -> None:
        """Start an interval now.

        Args:
          stats: the scheduler snapshot to report for each replica until it steps.
          engine_indexes: the data-parallel replicas recorded (`record`'s `engine_idx`).
        """
        if not engine_indexes:
            raise ValueError("LoggingStatLogger needs at least one engine index")
        self._interval_start = time.monotonic()
        self._prompt_tokens = self._generation_tokens = 0
        self._last_prompt_tput = self._last_generation_tput = 0.0
        initial = SchedulerStats() if stats is None else stats
        self._stats = dict.fromkeys(engine_indexes, initial)  # the latest, per replica
        # Prefix-cache tokens since start: the hit rate is cumulative (vLLM's is over its most
        # recent requests), so a quiet interval does not reset it to zero.
        self._queries = self._hits = 0
        self._external_queries = self._external_hits = 0  # a KV connector's (offloading)
        self._spec_decoding = SpecDecodingLogging()  # its own line, when drafts were verified

    def record(self, scheduler_stats: SchedulerStats,
               iteration_stats: IterationStats | None = None, engine_idx: int = 0) -> None:
        """Remember replica `engine_idx`'s latest scheduler snapshot; add a step's tokens."""
        if engine_idx not in self._stats:
            raise ValueError(f"engine_idx {engine_idx} is not one of this logger's "
                             f"{sorted(self._stats)}")
        self._stats[engine_idx] = scheduler_stats
        it = iteration_stats
        if it is not None:
            self._prompt_tokens += it.num_prompt_tokens
            self._generation_tokens += it.num_generation_tokens
            self._queries += it.prefix_cache_queries
            self._hits += it.prefix_cache_hits
            self._external_queries += it.connector_prefix_cache_queries
            self._external_hits += it.connector_prefix_cache_hits
            if it.spec_decoding is not None:
                self._spec_decoding.observe(it.spec_decoding)

    def log(self, now: float | None = None) -> str:
        """Log the line for the interval since the last call (at DEBUG level when idle).

        Returns:
          The logged message.
        """
        now = time.monotonic() if now is None else now
        elapsed = now - self._interval_start
        prompt_tput = self._prompt_tokens / elapsed if elapsed > 0 else 0.0
        generation_tput = self._generation_tokens / elapsed if elapsed > 0 else 0.0
        idle = not any((prompt_tput, generation_tput, self._last_prompt_tput,
                        self._last_generation_tput))
        self._last_prompt_tput, self._last_generation_tput = prompt_tput, generation_tput
        self._interval_start, self._prompt_tokens, self._generation_tokens = now, 0, 0
        stats = self._stats.values()
        running = sum(s.num_running for s in stats)
        waiting = sum(s.num_waiting for s in stats)
        kv_usage = sum(s.kv_cache_usage for s in stats) / len(stats)
        hit_rate = self._hits / self._queries if self._queries else 0.0
        message = (f"Avg prompt throughput: {prompt_tput:.1f} tokens/s, "
                   f"Avg generation throughput: {generation_tput:.1f} tokens/s, "
                   f"Running: {running} reqs, Waiting: {waiting} reqs, "
                   f"GPU KV cache usage: {kv_usage * 100:.1f}%, "
                   f"Prefix cache hit rate: {hit_rate * 100:.1f}%")
        if self._external_queries:  # vLLM adds it when a KV connector is configured
            external = self._external_hits / self._external_queries
            message += f", External prefix cache hit rate: {external * 100:.1f}%"
        # An idle server would repeat the same zeros forever: keep them out of INFO.
        logger.log(logging.DEBUG if idle else logging.INFO, message)
        self._spec_decoding.log(elapsed)
        return message
