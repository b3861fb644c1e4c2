"""Engine-side bookkeeping of one request: text, logprobs, times; turned into `RequestOutput`s.

The scheduler owns token-level progress; this keeps what only the engine knows (the prompt
text, the detokenizer, logprobs, wall-clock times) and applies each step's `RequestDelta`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from jaxengine.engine.detokenizer import IncrementalDetokenizer
from jaxengine.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxengine.runner.runner import SampledToken


@dataclass(slots=True, kw_only=True)
class TrackedRequest:
    """Mutable host state of one live request (private to the engine)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: Any  # scheduler.SamplingParams
    seed: int
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    def on_scheduled(self, now: float, num_computed_before: int) -> None:
        """Record the first time the request is scheduled (and its prefix-cache hit)."""
        if self.metrics.first_scheduled_time is None:
            self.metrics = dataclasses.replace(self.metrics, first_scheduled_time=now)
            self.num_cached_tokens = num_computed_before

    def apply(self, delta: Any, sampled: SampledToken | None, now: float) -> bool:
        """Apply one step's delta; return True if a stop string ended the request here.

        Args:
          delta: the scheduler's `RequestDelta` for this request.
          sampled: the runner's token with its logprobs (None if nothing was sampled).
          now: wall-clock time of the step's end.
        """
        new = list(delta.new_token_ids)
        self.token_ids.extend(new)
        if new and sampled is not None and self.params.logprobs is not None:
            self._add_logprobs(sampled)
        stop_hit = None
        if self.detokenizer is not None and new:
            ended_by_token = delta.finish_reason == "stop"
            stop_hit = self.detokenizer.update(new, skip_last=ended_by_token)
        if new:
            m = self.metrics
            self.metrics = dataclasses.replace(
                m, first_token_time=m.first_token_time or now, last_token_time=now,
                num_generation_tokens=len(self.token_ids))
        if stop_hit is not None:
            self.finish_reason, self.stop_reason = "stop", stop_hit
        elif delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        if self.finish_reason is not None:
            self.metrics = dataclasses.replace(self.metrics, finished_time=now)
        return stop_hit is not None and delta.finish_reason is None

    def abort(self, now: float) -> RequestOutput:
        """Finish as aborted at `now` (vLLM's finish_reason "abort"); the final output."""
        self.finish_reason, self.stop_reason = "abort", None
        self.metrics = dataclasses.replace(self.metrics, finished_time=now)
        return self.output()

    def _add_logprobs(self, sampled: SampledToken) -> None:
        tok = self.detokenizer.tokenizer if self.detokenizer is not None else None

        def text(tid: int) -> str | None:
            return None if tok is None else tok.decode([tid], skip_special_tokens=False)

        entry = {tid: Logprob(lp, rank, text(tid)) for rank, (tid, lp) in
                 enumerate(sampled.top_logprobs, start=1)}
        if sampled.token_id not in entry:
            entry = {sampled.token_id: Logprob(sampled.logprob or 0.0, None,
                                               text(sampled.token_id)), **entry}
        if self.logprobs is None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        self.logprobs.append(entry)
        self.cumulative_logprob = (self.cumulative_logprob or 0.0) + (sampled.logprob or 0.0)

    def output(self) -> RequestOutput:
        """A snapshot as vLLM's `RequestOutput`."""
        finished = self.finish_reason is not None
        d = self.detokenizer
        text = d.visible_text(finished=finished) if d is not None else ""
        completion = CompletionOutput(
            index=0, text=text, token_ids=tuple(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason)
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids), outputs=[completion],
            finished=finished, metrics=self.metrics, num_cached_tokens=self.num_cached_tokens)
