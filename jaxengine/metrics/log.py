"""vLLM's periodic throughput log line, computed from the same statistics as Prometheus."""

from __future__ import annotations

import logging
import time

from jaxengine.engine.stats import IterationStats
from scheduler import SchedulerStats

logger = logging.getLogger("jaxengine.metrics")


class LoggingStatLogger:
    """Accumulates token counts between `log()` calls and logs throughput and queue sizes."""

    def __init__(self, stats: SchedulerStats | None = None) -> None:
        """Start an interval now; `stats` is the scheduler snapshot to report until a step."""
        self._interval_start = time.monotonic()
        self._prompt_tokens = self._generation_tokens = 0
        self._last_prompt_tput = self._last_generation_tput = 0.0
        self._stats = SchedulerStats() if stats is None else stats
        # Prefix-cache tokens since start: the hit rate is cumulative (vLLM's is over its most
        # recent requests), so a quiet interval does not reset it to zero.
        self._queries = self._hits = 0

    def record(self, scheduler_stats: SchedulerStats,
               iteration_stats: IterationStats | None = None) -> None:
        """Remember the latest scheduler snapshot and add a step's token counts."""
        self._stats = scheduler_stats
        it = iteration_stats
        if it is not None:
            self._prompt_tokens += it.num_prompt_tokens
            self._generation_tokens += it.num_generation_tokens
            self._queries += it.prefix_cache_queries
            self._hits += it.prefix_cache_hits

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
        s = self._stats
        hit_rate = self._hits / self._queries if self._queries else 0.0
        message = (f"Avg prompt throughput: {prompt_tput:.1f} tokens/s, "
                   f"Avg generation throughput: {generation_tput:.1f} tokens/s, "
                   f"Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
                   f"GPU KV cache usage: {s.kv_cache_usage * 100:.1f}%, "
                   f"Prefix cache hit rate: {hit_rate * 100:.1f}%")
        # An idle server would repeat the same zeros forever: keep them out of INFO.
        logger.log(logging.DEBUG if idle else logging.INFO, message)
        return message
