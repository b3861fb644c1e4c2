"""Engine-side bookkeeping of one request: text, logprobs, times; turned into `RequestOutput`s.

The scheduler owns token-level progress; this keeps what only the engine knows (the prompt
text, the detokenizer, logprobs, wall-clock times). In a step, `detokenize` decodes the sampled
token first (so a stop string it completes goes to the scheduler with the token), then `apply`
takes the scheduler's `RequestDelta`. `sampling_rows` reads a plan's sampler rows off them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from jaxengine.engine.detokenizer import IncrementalDetokenizer, StreamingTokenizer
from jaxengine.engine.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from jaxengine.engine.stats import FinishedRequestStats
from jaxengine.runner.in_flight import SampledToken
from jaxengine.sampling.rows import SamplingRow
from jaxengine.structured.matcher import GrammarMatcher
from scheduler import LoRARequest, Request, RequestDelta, SamplingParams, SchedulerOutput


@dataclass(slots=True, kw_only=True)
class TrackedRequest:
    """Mutable host state of one live request (private to the engine)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    detokenizer: IncrementalDetokenizer | None
    # Its times (`metrics` snapshots them with the output count, as an output needs them):
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words, tokenized
    # params.structured_outputs' matcher once its grammar compiled (None before, or without)
    grammar: GrammarMatcher | None = None
    # params.prompt_logprobs' entries so far ([None] at first; None when not asked for)
    prompt_logprobs: PromptLogprobs | None = None
    lora_request: LoRARequest | None = None  # the adapter it is served with; None: the base

    def __post_init__(self) -> None:
        if self.prompt_logprobs is None and self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @classmethod
    def start(cls, request: Request, *, prompt: str | None, seed: int,
              tokenizer: StreamingTokenizer | None,
              bad_words_token_ids: tuple[tuple[int, ...], ...]) -> TrackedRequest:
        """The engine's state of a request just queued (its `sampling_params` the checked
        ones, with the model's EOS ids).

        Args:
          request: the scheduler's request.
          prompt: its text (None: given as token ids).
          seed: its sampler's seed (its own, or one the engine drew).
          tokenizer: decodes its outputs (None: token ids only, no stop strings).
          bad_words_token_ids: its `bad_words`, tokenized.
        """
        params = request.sampling_params
        ids = list(request.prompt_token_ids)
        detokenizer = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, ids, stop=params.stop, min_tokens=params.min_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens)
        return cls(request_id=request.request_id, prompt=prompt, prompt_token_ids=ids,
                   params=params, seed=seed, detokenizer=detokenizer,
                   arrival_time=request.arrival_time, bad_words_token_ids=bad_words_token_ids,
                   lora_request=request.lora_request)

    @property
    def metrics(self) -> RequestMetrics:
        """Its times and output count now."""
        return RequestMetrics(
            arrival_time=self.arrival_time, first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time, last_token_time=self.last_token_time,
            finished_time=self.finished_time, num_generation_tokens=len(self.token_ids))

    def on_scheduled(self, now: float, num_computed_before: int) -> None:
        """Record the first time the request is scheduled (and its prefix-cache hit)."""
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now
            self.num_cached_tokens = num_computed_before

    def detokenize(self, token_id: int) -> str | None:
        """Decode this step's sampled token; return the stop string it completes, if any.

        Runs before the scheduler sees the token, which receives the stop string with it.
        """
        if self.detokenizer is None:
            return None
        return self.detokenizer.update([token_id])

    def apply(self, delta: RequestDelta, sampled: SampledToken | None, now: float) -> None:
        """Take the scheduler's delta of this step (its token was already detokenized).

        Args:
          delta: the scheduler's `RequestDelta` for this request.
          sampled: the runner's token with its logprobs (None if nothing was sampled).
          now: wall-clock time of the step's end.
        """
        new = delta.new_token_ids
        self.token_ids.extend(new)
        if new and sampled is not None and self.params.logprobs is not None:
            self._add_logprobs(sampled)
        if new:
            self.first_token_time = self.first_token_time or now
            self.last_token_time = now
        if delta.finish_reason is None:
            return
        if (delta.finish_reason == "stop" and not isinstance(delta.stop_reason, str)
                and self.detokenizer is not None):
            self.detokenizer.drop_last_token()  # EOS or a stop token id: never shown (vLLM)
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        self.finished_time = now

    def abort(self, now: float) -> RequestOutput:
        """Finish as aborted at `now` (vLLM's finish_reason "abort"); the final output."""
        self.finish_reason, self.stop_reason = "abort", None
        self.finished_time = now
        return self.output()

    def finished_stats(self) -> FinishedRequestStats:
        """What this finished request adds to the request-level histograms."""
        m = self.metrics
        assert self.finish_reason is not None and m.e2e_latency is not None
        return FinishedRequestStats(
            finish_reason=self.finish_reason, num_prompt_tokens=len(self.prompt_token_ids),
            num_generation_tokens=len(self.token_ids), e2e_latency=m.e2e_latency,
            # never scheduled (aborted while waiting): it queued all its life
            queued_time=m.time_in_queue if m.time_in_queue is not None else m.e2e_latency,
            mean_time_per_output_token=m.tpot, max_tokens_param=self.params.max_tokens)

    def _add_logprobs(self, sampled: SampledToken) -> None:
        tok = self.detokenizer.tokenizer if self.detokenizer is not None else None

        def text(tid: int) -> str | None:
            return None if tok is None else tok.decode([tid], skip_special_tokens=False)

        entry = {tid: Logprob(lp, rank, text(tid)) for rank, (tid, lp) in
                 enumerate(sampled.top_logprobs, start=1)}
        if sampled.token_id not in entry:
            entry = {sampled.token_id: Logprob(sampled.logprob or 0.0, sampled.rank,
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
            finished=finished, metrics=self.metrics, num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            lora_request=self.lora_request)


def sampling_rows(plan: SchedulerOutput, tracked: Mapping[str, TrackedRequest],
                  eos_token_id: int | None) -> dict[str, SamplingRow]:
    """Parameters, seed and output position (what the PRNG key folds in) of each request that
    `plan` samples, from `tracked` (which may hold requests that finished since the plan was
    made)."""
    rows = {}
    spec = plan.scheduled_spec_decode_tokens
    for rid in plan.sampling_req_ids:
        t = tracked[rid]
        # The sampled token's index among the outputs, from the plan: the host may not have
        # the tokens before it yet (async scheduling).
        end = plan.num_computed_tokens[rid] + plan.num_scheduled_tokens[rid]
        position = end - len(t.prompt_token_ids) - len(spec.get(rid, ()))
        rows[rid] = SamplingRow(params=t.params, seed=t.seed, position=position,
                                eos_token_id=eos_token_id, prompt_token_ids=t.prompt_token_ids,
                                output_token_ids=t.token_ids,
                                bad_words_token_ids=t.bad_words_token_ids, grammar=t.grammar)
    return rows
