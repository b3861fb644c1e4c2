"""Stat loggers of data-parallel replicas: each replica's engine records under its index.

An `LLMEngine` hands its statistics to `stat_loggers` as `record(scheduler_stats,
iteration_stats)`, not knowing which replica it is; `EngineStatLogger` adds the index, so one
`PrometheusStatLogger` (one registry, an `engine` label per replica) or one
`LoggingStatLogger` (one log line) can serve every replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from jaxengine.engine.stats import IterationStats
from scheduler import SchedulerStats


class IndexedStatLogger(Protocol):
    """A stat logger that records per replica (`PrometheusStatLogger`, `LoggingStatLogger`)."""

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats | None,
               engine_idx: int = 0) -> None:
        """Take replica `engine_idx`'s statistics."""
        ...


class EngineStatLogger:
    """`logger` as the `StatLogger` of replica `engine_idx`'s engine."""

    __slots__ = ("engine_idx", "logger")

    def __init__(self, logger: IndexedStatLogger, engine_idx: int) -> None:
        """Record into `logger` under `engine_idx`."""
        self.logger, self.engine_idx = logger, engine_idx

    def record(self, scheduler_stats: SchedulerStats,
               iteration_stats: IterationStats | None) -> None:
        """`logger.record(..., engine_idx=engine_idx)`."""
        self.logger.record(scheduler_stats, iteration_stats, engine_idx=self.engine_idx)


def attach_stat_loggers(replicas: Sequence[Any], *loggers: IndexedStatLogger) -> None:
    """Make each logger receive every replica's statistics, replica i's under index i.

    Args:
      replicas: engines with a `stat_loggers` list (`LLMEngine`s), in replica order.
      loggers: per-replica loggers whose engine indexes cover `range(len(replicas))`.
    """
    for i, engine in enumerate(replicas):
        engine.stat_loggers += [EngineStatLogger(logger, i) for logger in loggers]
