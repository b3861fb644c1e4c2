"""vLLM-shaped results: `RequestOutput` with one `CompletionOutput`, logprobs and metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scheduler import LoRARequest


@dataclass(frozen=True, slots=True)
class Logprob:
    """Raw log probability of one token (vLLM's `Logprob`)."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token; None when not known
    decoded_token: str | None = None


# One dict per output token: the sampled token and the top-n, by token id.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first, then the prompt token and the top-n (vLLM's).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One generated sequence."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs (if asked)
    logprobs: SampleLogprobs | None  # None unless SamplingParams.logprobs was set
    finish_reason: str | None = None  # None while running, then "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Wall-clock times (seconds since the epoch, `time.time()`) of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def time_in_queue(self) -> float | None:
        """Arrival to first scheduling."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (None with fewer than two tokens)."""
        if self.num_generation_tokens < 2 or self.last_token_time is None:
            return None
        assert self.first_token_time is not None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to finish."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """The state of one request after a step (vLLM's `RequestOutput`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    # SamplingParams.prompt_logprobs' (None unless set): the positions computed so far, all
    # of them once the prompt is processed (such a request never reads the prefix cache)
    prompt_logprobs: PromptLogprobs | None = None
    # A prefill instance's finished request: the handle a decode instance loads its KV by
    # (vLLM's name; docs/DESIGN.md "Prefill/decode disaggregation"); None otherwise
    kv_transfer_params: dict[str, Any] | None = None
    lora_request: LoRARequest | None = None  # the adapter it was served with (vLLM's field)
