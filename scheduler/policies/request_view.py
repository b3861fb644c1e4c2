"""`RequestView`: what a policy sees of one request, read lazily from the scheduler's columns.

A policy (`scheduler/policies/policies.py`) is called inside a pure function, on its private
working copy of the state (`Work`, scheduler/core/_work.py). Building a full `Request` per call
would copy its token history; a view instead holds the request id and reads each field from the
copy's columns (`Columns`: what a view reads of it) when the policy asks for it, so a policy
pays only for what it reads. A view is valid only during the policy call it was passed to (it
reads the working copy, which changes as the step goes on).
"""

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Protocol

from scheduler.kv.hashing import BlockHash
from scheduler.kv.kv_cache import KVCacheManager
from scheduler.metadata import RequestMetadata
from scheduler.request import LoRARequest, Request, RequestStatus
from scheduler.sampling_params import SamplingParams


class Columns(Protocol):
    """What a view reads of the scheduler's working copy (`Work` is one)."""

    @property
    def static(self) -> Mapping[str, Request]:
        """Each unfinished request as added, with its status, preemptions and drafts now."""

    @property
    def tokens(self) -> Mapping[str, list[int]]:
        """Each request's prompt and output tokens."""

    @property
    def computed(self) -> Mapping[str, int]:
        """Each request's computed tokens."""

    @property
    def served(self) -> Mapping[str | None, int]:
        """Tokens served to finished requests, by tenant."""

    @property
    def kv(self) -> KVCacheManager:
        """The KV pool, for prefix-cache hashes and hits."""


class RequestView:
    """One request as a policy sees it: what was asked, and its progress now (read-only)."""

    __slots__ = ("_req", "_rid", "_w")

    def __init__(self, work: Columns, rid: str) -> None:
        self._w = work
        self._rid = rid
        self._req: Request = work.static[rid]

    # ---- what was asked (as added) -------------------------------------------------------

    @property
    def request_id(self) -> str:
        return self._rid

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self._req.prompt_token_ids

    @property
    def sampling_params(self) -> SamplingParams:
        return self._req.sampling_params

    @property
    def arrival_time(self) -> float:
        return self._req.arrival_time

    @property
    def priority(self) -> int:
        return self._req.priority

    @property
    def cache_salt(self) -> str | None:
        return self._req.cache_salt

    @property
    def lora_request(self) -> LoRARequest | None:
        """Its LoRA adapter (docs §14), e.g. for a policy that groups requests by adapter."""
        return self._req.lora_request

    @property
    def metadata(self) -> RequestMetadata:
        """Who sent it (read-only), e.g. {"tenant": "a", "user": "u1"}; empty if not given."""
        return self._req.metadata  # type: ignore[return-value]  # always a RequestMetadata

    # ---- progress now ------------------------------------------------------------------

    @property
    def status(self) -> RequestStatus:
        """WAITING, PREEMPTED, WAITING_FOR_FSM (its grammar is compiling, docs §12) or
        WAITING_FOR_REMOTE_KVS (its KV is being loaded, docs §11) while in `waiting`, RUNNING
        while in `running`."""
        return self._req.status

    @property
    def num_preemptions(self) -> int:
        return self._req.num_preemptions

    @property
    def num_prompt_tokens(self) -> int:
        return len(self._req.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens sampled so far."""
        return len(self._w.tokens[self._rid])

    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled so far (kept across preemptions)."""
        return len(self._w.tokens[self._rid]) - len(self._req.prompt_token_ids)

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        """The tokens sampled so far (a copy: prefer `num_output_tokens` when it is enough)."""
        return tuple(self._w.tokens[self._rid][len(self._req.prompt_token_ids):])

    @property
    def block_hashes(self) -> tuple[BlockHash, ...]:
        """The prefix-cache hashes (docs §5) of its full blocks, in order: the keys a KV
        connector that stores blocks by content looks up (docs §11)."""
        w, req = self._w, self._req
        tokens = w.tokens[self._rid]
        count = len(tokens) // w.kv.block_size
        return w.kv.block_hashes(self._rid, tokens, count, req.cache_salt, req.lora_name)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is in the cache (0 in `waiting`: a preempted request lost its KV;
        except KV a connector has loaded, or is loading, for it: docs §11)."""
        return self._w.computed[self._rid]

    @property
    def num_cached_tokens(self) -> int:
        """For a request in `waiting`: the tokens its admission would take from the prefix
        cache now (a whole number of blocks, never its last token; 0 with caching off). For a
        running request, or one whose KV a connector loads: 0 (its KV is counted by
        `num_computed_tokens`)."""
        req = self._req
        if req.status == RequestStatus.RUNNING or self._w.computed[self._rid]:
            return 0
        w = self._w
        tokens = w.tokens[self._rid]
        hit = w.kv.find_cached_prefix(self._rid, tokens, len(tokens), req.cache_salt,
                                      req.lora_name)
        return len(hit[0]) * w.kv.block_size

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens the model must still compute before the request has KV for all it has:
        `num_tokens - num_computed_tokens` when running; `num_tokens - num_cached_tokens` in
        `waiting`, so a resumed request counts the outputs it must recompute."""
        if self._req.status == RequestStatus.RUNNING or self._w.computed[self._rid]:
            return self.num_tokens - self.num_computed_tokens
        return self.num_tokens - self.num_cached_tokens

    @property
    def num_served_tokens(self) -> int:
        """Tokens served so far, each counted once: prompt tokens computed (all of them once it
        has an output, else `min(num_computed_tokens, num_prompt_tokens)`; a prefix-cache hit
        counts as served) plus `num_output_tokens`. Recomputation after a preemption adds
        nothing; a request preempted before its first output is back to 0."""
        num_output = self.num_output_tokens
        num_prompt = len(self._req.prompt_token_ids)
        if num_output:
            return num_prompt + num_output
        return min(self._w.computed[self._rid], num_prompt)

    def __repr__(self) -> str:
        return (f"RequestView({self._rid!r}, status={self.status.name}, "
                f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})")


class RequestViews(Mapping[str, RequestView]):
    """Read-only mapping id -> `RequestView` of every unfinished request of a `Work`; each
    lookup builds a fresh view (a few attribute writes)."""

    __slots__ = ("_w",)

    def __init__(self, work: Columns) -> None:
        self._w = work

    def __getitem__(self, rid: str) -> RequestView:
        return RequestView(self._w, rid)

    def __iter__(self) -> Iterator[str]:
        return iter(self._w.static)

    def __len__(self) -> int:
        return len(self._w.static)

    @property
    def finished_served(self) -> Mapping[str | None, int]:
        """`num_served_tokens` summed over the finished requests of each tenant
        (`metadata["tenant"]`; None for requests without one), since the first state."""
        return MappingProxyType(self._w.served)
