"""Per-step statistics (vLLM's `IterationStats`) derived from an engine step's outputs.

The engine returns `RequestOutput`s with cumulative token ids and wall-clock times, and the
scheduler keeps cumulative counters. `StepTracker` diffs both against what it saw last step, so
the engine itself needs no metrics hook: whoever drives `step()` feeds the tracker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jaxengine.engine.outputs import RequestOutput
from scheduler import SchedulerStats


@dataclass(frozen=True, slots=True, kw_only=True)
class FinishedRequestStats:
    """What a finished request contributes to the request-level histograms."""

    finish_reason: str  # "stop", "length" or "abort" (the client left, or the server stopped it)
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float  # seconds, arrival to finish
    queued_time: float  # seconds, arrival to first scheduling
    mean_time_per_output_token: float | None  # seconds; None with fewer than two tokens
    max_tokens_param: int | None  # the request's max_tokens, when known


@dataclass(frozen=True, slots=True, kw_only=True)
class IterationStats:
    """What one engine step did (the counters are increments, not totals)."""

    timestamp: float  # time.time() at the end of the step
    num_prompt_tokens: int = 0  # prompts of requests that produced their first token
    num_generation_tokens: int = 0  # tokens generated in this step
    num_preempted_reqs: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up at first admissions
    prefix_cache_hits: int = 0  # of those, tokens found in the cache
    time_to_first_tokens: tuple[float, ...] = ()  # seconds, one per request's first token
    inter_token_latencies: tuple[float, ...] = ()  # seconds since each request's last token
    finished_requests: tuple[FinishedRequestStats, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Prompt plus generation tokens (what `iteration_tokens_total` observes)."""
        return self.num_prompt_tokens + self.num_generation_tokens


class StepTracker:
    """Turns consecutive steps' outputs and scheduler counters into `IterationStats`."""

    def __init__(self, stats: SchedulerStats) -> None:
        """Start from the scheduler's current counters (earlier activity is not re-counted)."""
        self._last = stats
        # request id -> (tokens generated so far, time of the last one)
        self._seen: dict[str, tuple[int, float | None]] = {}
        self._max_tokens: dict[str, int | None] = {}

    def track(self, request_id: str, max_tokens: int | None) -> None:
        """Remember a new request's max_tokens (reported when it finishes)."""
        self._max_tokens[request_id] = max_tokens

    def observe_aborted(self, outputs: Sequence[RequestOutput], now: float) -> IterationStats:
        """The statistics of requests aborted between steps: each one finished, "abort".

        Args:
          outputs: what `LLMEngine.abort_request()` returned.
          now: time.time() of the abort.
        """
        return IterationStats(timestamp=now,
                              finished_requests=tuple(self._finished(out) for out in outputs))

    def observe(self, outputs: Sequence[RequestOutput], stats: SchedulerStats,
                now: float) -> IterationStats:
        """The statistics of the step that produced `outputs` and left the scheduler at `stats`.

        Args:
          outputs: what `LLMEngine.step()` returned.
          stats: `engine.snapshot().stats` right after that step.
          now: time.time() at the end of the step.
        """
        prompt = generation = 0
        ttfts: list[float] = []
        itls: list[float] = []
        finished: list[FinishedRequestStats] = []
        for out in outputs:
            before, last_time = self._seen.get(out.request_id, (0, None))
            n = len(out.outputs[0].token_ids)
            new = n - before
            generation += max(new, 0)
            if before == 0 and new > 0:
                prompt += len(out.prompt_token_ids)
                if out.metrics.ttft is not None:
                    ttfts.append(out.metrics.ttft)
            elif new > 0 and last_time is not None and out.metrics.last_token_time is not None:
                itls.append(out.metrics.last_token_time - last_time)
            self._seen[out.request_id] = (n, out.metrics.last_token_time)
            if out.finished:
                finished.append(self._finished(out))
        last, self._last = self._last, stats
        return IterationStats(
            timestamp=now, num_prompt_tokens=prompt, num_generation_tokens=generation,
            num_preempted_reqs=stats.num_preemptions - last.num_preemptions,
            prefix_cache_queries=stats.prefix_cache_queries - last.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits - last.prefix_cache_hits,
            time_to_first_tokens=tuple(ttfts), inter_token_latencies=tuple(itls),
            finished_requests=tuple(finished))

    def _finished(self, out: RequestOutput) -> FinishedRequestStats:
        self._seen.pop(out.request_id, None)
        max_tokens = self._max_tokens.pop(out.request_id, None)
        m, completion = out.metrics, out.outputs[0]
        e2e = m.e2e_latency if m.e2e_latency is not None else 0.0
        return FinishedRequestStats(
            finish_reason=completion.finish_reason or "stop",
            num_prompt_tokens=len(out.prompt_token_ids),
            num_generation_tokens=len(completion.token_ids), e2e_latency=e2e,
            # never scheduled (aborted while waiting): it queued all its life
            queued_time=m.time_in_queue if m.time_in_queue is not None else e2e,
            mean_time_per_output_token=m.tpot,
            max_tokens_param=max_tokens)
