"""What one engine step did, for metrics: vLLM's `IterationStats` and `FinishedRequestStats`.

The engine fills one `IterationStats` per `step()` as it makes the step's outputs (and one per
`abort_request()` that finished something), then hands it, with the scheduler's
`SchedulerStats` snapshot, to each `StatLogger` it holds (a step's is made only when it holds
one, or offloads KV to the host, whose transfers go into it). Nothing outside the engine
re-derives these from outputs; `jaxengine.metrics` only records them (Prometheus, the log line).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from jaxengine.kv_offload.worker import KVTransferStats
from jaxengine.spec.metrics import SpecDecodingStats
from scheduler import SchedulerCounters, SchedulerStats


@dataclass(frozen=True, slots=True, kw_only=True)
class FinishedRequestStats:
    """What a finished request contributes to the request-level histograms."""

    finish_reason: str  # "stop", "length" or "abort" (the client left, or the server stopped it)
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float  # seconds, arrival to finish
    queued_time: float  # seconds, arrival to first scheduling
    mean_time_per_output_token: float | None  # seconds; None with fewer than two tokens
    max_tokens_param: int | None  # the request's max_tokens


@dataclass(slots=True, kw_only=True)
class IterationStats:
    """What one engine step did (the counters are increments, not totals).

    The engine fills it while it makes the step's outputs; loggers only read it.
    """

    timestamp: float  # time.time() at the end of the step
    num_prompt_tokens: int = 0  # prompts of requests that produced their first token
    num_generation_tokens: int = 0  # tokens generated in this step
    num_preempted_reqs: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up at first admissions
    prefix_cache_hits: int = 0  # of those, tokens found in the cache
    connector_prefix_cache_queries: int = 0  # tokens past the local hit asked of a KV connector
    connector_prefix_cache_hits: int = 0  # of those, tokens it loads (e.g. from host memory)
    time_to_first_tokens: list[float] = field(default_factory=list)  # s, one per first token
    inter_token_latencies: list[float] = field(default_factory=list)  # s since the last token
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    kv_offload_transfers: list[KVTransferStats] = field(default_factory=list)  # host offloading
    kv_offload_usage: float | None = None  # host store: blocks held / capacity (None: off)
    spec_decoding: SpecDecodingStats | None = None  # drafts verified (None: none this step)

    @classmethod
    def between(cls, before: SchedulerCounters, after: SchedulerCounters, *,
                timestamp: float) -> IterationStats:
        """A step's statistics, with the scheduler counters it moved from `before` to `after`."""
        return cls(timestamp=timestamp,
                   num_preempted_reqs=after.num_preemptions - before.num_preemptions,
                   prefix_cache_queries=after.prefix_cache_queries - before.prefix_cache_queries,
                   prefix_cache_hits=after.prefix_cache_hits - before.prefix_cache_hits,
                   connector_prefix_cache_queries=(after.connector_prefix_cache_queries
                                                   - before.connector_prefix_cache_queries),
                   connector_prefix_cache_hits=(after.connector_prefix_cache_hits
                                                - before.connector_prefix_cache_hits))

    @property
    def num_tokens(self) -> int:
        """Prompt plus generation tokens (what `iteration_tokens_total` observes)."""
        return self.num_prompt_tokens + self.num_generation_tokens

    def observe_tokens(self, num_new: int, *, prompt_len: int, before: TokenTimes) -> None:
        """Count a request's `num_new` tokens of this step (vLLM's `update_from_output`).

        Args:
          num_new: tokens the request got in this step (0 counts nothing).
          prompt_len: its prompt length, counted with its first token.
          before: its times before this step: first token or not, and the last token's time.
        """
        if num_new == 0:
            return
        self.num_generation_tokens += num_new
        if before.first_token_time is None:
            self.num_prompt_tokens += prompt_len
            self.time_to_first_tokens.append(self.timestamp - before.arrival_time)
        else:
            assert before.last_token_time is not None
            self.inter_token_latencies.append(self.timestamp - before.last_token_time)


class TokenTimes(Protocol):
    """A request's times that `observe_tokens` reads (a `RequestMetrics` has them, and so has
    the engine's live request)."""

    @property
    def arrival_time(self) -> float: ...
    @property
    def first_token_time(self) -> float | None: ...
    @property
    def last_token_time(self) -> float | None: ...


class StatLogger(Protocol):
    """Receives every step's statistics (vLLM's `StatLoggerBase.record`)."""

    def record(self, scheduler_stats: SchedulerStats,
               iteration_stats: IterationStats | None) -> None:
        """Take the scheduler's snapshot after a step and what the step did (None: no step)."""
        ...
