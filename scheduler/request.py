"""Requests as the scheduler sees them: lifecycle status, progress counters, LoRA adapter.

Their sampling limits are `SamplingParams` (scheduler/sampling_params.py), imported here.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum

from scheduler.metadata import NO_METADATA, RequestMetadata
from scheduler.sampling_params import SamplingParams


class RequestStatus(IntEnum):
    """Lifecycle of a request, ordered: every status past PREEMPTED is finished."""

    WAITING = 0
    WAITING_FOR_FSM = 1  # its structured-output grammar is still compiling (docs §12)
    WAITING_FOR_REMOTE_KVS = 2
    RUNNING = 3
    PREEMPTED = 4
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7

    @property
    def is_finished(self) -> bool:
        """True for the three FINISHED_* statuses."""
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """vLLM's finish reason string: "stop", "length", "abort" or None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A LoRA adapter a request is served with (vLLM's `LoRARequest`; docs/SCHEDULING.md §14).

    Raises:
        ValueError: an empty name or path, or an id below 1 (the message names the field).
    """

    lora_name: str  # keys the request's prefix-cache blocks: adapters never share KV
    lora_int_id: int  # >= 1; the per-step `max_loras` limit counts distinct ids
    lora_path: str  # where the adapter's files are (read by the model runner, not here)

    def __post_init__(self) -> None:
        for name in ("lora_name", "lora_path"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"LoRARequest {name}={value!r} must be a non-empty string")
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest lora_int_id={self.lora_int_id!r} must be an int >= 1 "
                             "(0 would mean the base model, which needs no LoRARequest)")


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """One request: what was asked (first eleven fields) and how far it has got.

    Progress is two counters, never phase flags: `num_tokens` (prompt + outputs) and
    `num_computed_tokens` (tokens whose KV is in the cache). Users create requests with the
    first fields only; the scheduler fills in the progress fields of the copies it hands out.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0  # seconds; orders FCFS ties and priority ties
    priority: int = 0  # lower runs first under the priority policy
    eos_token_id: int | None = None  # stops the request unless ignore_eos
    cache_salt: str | None = None  # isolates this request's prefix-cache entries
    # Who asked, for policies (e.g. {"tenant": "a", "user": "u1"}); any mapping of str keys to
    # str/int/float/bool values is stored as a read-only `RequestMetadata`.
    metadata: Mapping[str, str | int | float | bool] = field(default=NO_METADATA, hash=False)
    # Its output follows a grammar that must be compiled first: it waits as WAITING_FOR_FSM
    # until `grammars_ready` names it (docs/SCHEDULING.md §12).
    use_structured_output: bool = False
    # Admission never reads the prefix cache for it (vLLM V1's name): a cached position would
    # have no prompt logprobs. None: True exactly when `sampling_params.prompt_logprobs` is set.
    skip_reading_prefix_cache: bool | None = None
    # The LoRA adapter it is served with; None: the base model (docs/SCHEDULING.md §14).
    lora_request: LoRARequest | None = None
    output_token_ids: tuple[int, ...] = ()  # sampled so far
    spec_token_ids: tuple[int, ...] = ()  # draft tokens to verify in the next step
    num_computed_tokens: int = 0  # tokens with KV in the cache
    num_output_placeholders: int = 0  # async scheduling: scheduled outputs not yet sampled
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0  # times preempted (each one recomputes everything)
    stop_reason: int | str | None = None  # stop token id or stop string that finished it

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        object.__setattr__(self, "output_token_ids", tuple(self.output_token_ids))
        object.__setattr__(self, "spec_token_ids", tuple(self.spec_token_ids))
        if self.skip_reading_prefix_cache is None:
            object.__setattr__(self, "skip_reading_prefix_cache",
                               self.sampling_params.prompt_logprobs is not None)
        if self.lora_request is not None and not isinstance(self.lora_request, LoRARequest):
            raise ValueError(f"request {self.request_id!r}: lora_request="
                             f"{self.lora_request!r} must be a LoRARequest or None")
        if type(self.metadata) is not RequestMetadata:  # a copy keeps it read-only
            object.__setattr__(self, "metadata", RequestMetadata(self.metadata,
                                                                 owner=self.request_id))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """`num_tokens` plus the draft tokens awaiting verification."""
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def lora_name(self) -> str | None:
        """Its adapter's name, which keys its prefix-cache blocks; None for the base model."""
        return None if self.lora_request is None else self.lora_request.lora_name
