"""The engine's side of speculative decoding: verify a step's drafts, propose the next ones.

Per step: the runner samples every row of the plan (`verify.sampler_rows`),
`Speculator.verify` keeps each request's accepted tokens (`verify.num_accepted`), cut after the
first one that ends the request (EOS, a stop token id, max_tokens, max_model_len: the
scheduler's order, so the detokenizer never sees a token the scheduler drops), and counts
vLLM's `SpecDecodingStats`. After the detokenizer has cut at stop strings, `propose` drafts the
next step's tokens of each request still going (`update_from_output`'s `draft_token_ids`).

Under async scheduling (docs/DESIGN.md, "Speculative decoding") step N is collected after step
N+1 was dispatched. A request that N+1 decodes plainly gets drafts for N+2 that follow the token
N+1 samples, not known yet: the proposer drafts one token more from the known history and the
first (its guess of that token) is dropped (`tokens_in_flight` = 1). One whose drafts N+1
verifies gets none now: the engine finishes N+1 before it plans N+2, and proposes then.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from jaxengine.config.speculative import SpeculativeConfig
from jaxengine.runner.verify import draftable, num_accepted
from jaxengine.spec.metrics import SpecDecodingStats
from jaxengine.spec.ngram import propose_ngram
from scheduler import SchedulerOutput, check_stop

if TYPE_CHECKING:
    from jaxengine.engine.request_state import TrackedRequest


class _Token(Protocol):
    token_id: int


class Speculator:
    """Verifies and proposes drafts for one engine (host side, no device state)."""

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int,
                 eos_token_id: int | None) -> None:
        """Args: the parsed `speculative_config`; the engine's max_model_len and EOS id."""
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id

    def verify[T: _Token](self, plan: SchedulerOutput, rows: Mapping[str, Sequence[T]],
                          tracked: Mapping[str, TrackedRequest]
                          ) -> tuple[dict[str, list[T]], SpecDecodingStats | None]:
        """Each request's emitted tokens, and the step's statistics (None without drafts).

        Args:
          plan: the step's plan (its `scheduled_spec_decode_tokens`).
          rows: per sampling request, the tokens of its rows (1 + its drafts).
          tracked: the engine's requests (outputs so far, parameters).
        """
        drafted = plan.scheduled_spec_decode_tokens
        stats = SpecDecodingStats(num_spec_tokens=self.config.num_speculative_tokens)
        out = {}
        for rid, tokens in rows.items():
            drafts = drafted.get(rid, ())
            a = num_accepted(drafts, [t.token_id for t in tokens])
            if drafts:
                stats.observe_draft(len(drafts), a)
            kept = list(tokens[:a + 1])
            out[rid] = kept[:self._until_stop(tracked[rid], [t.token_id for t in kept])]
        return out, stats if stats.num_drafts else None

    def propose(self, tracked: Mapping[str, TrackedRequest],
                sampled: Mapping[str, Sequence[_Token]], stopped: Mapping[str, str],
                in_flight: SchedulerOutput | None = None) -> dict[str, list[int]]:
        """Drafts for the next step of each request that sampled `sampled` now (not yet in
        `tracked`) and may get them (`verify.draftable`), at most K and no more than its
        max_tokens and max_model_len leave room to verify; stopped requests get none.

        Args:
          in_flight: async scheduling: the plan dispatched after the step of `sampled`
            (see `tokens_in_flight`); None in the synchronous loop.
        """
        drafts = {}
        for rid, t, tokens, lag, room in self.to_draft(tracked, sampled, stopped, in_flight):
            history = [*t.prompt_token_ids, *t.token_ids, *(x.token_id for x in tokens)]
            proposal = self.propose_tokens(history, room + lag)[lag:]
            if proposal:
                drafts[rid] = proposal
        return drafts

    def to_draft[T: _Token](self, tracked: Mapping[str, TrackedRequest],
                            sampled: Mapping[str, Sequence[T]], stopped: Mapping[str, str],
                            in_flight: SchedulerOutput | None
                            ) -> Iterator[tuple[str, TrackedRequest, Sequence[T], int, int]]:
        """The requests of `sampled` that get a proposal now (`propose`'s arguments): each
        one's id, state, new tokens, tokens in flight before its drafts (`tokens_in_flight`:
        0 or 1) and how many drafts it may get (`draft_room`, > 0)."""
        for rid, tokens in sampled.items():
            lag = tokens_in_flight(in_flight, rid)
            if lag is None:
                continue
            t = tracked[rid]
            room = self.draft_room(t, len(tokens), stopped=rid in stopped, in_flight=lag)
            if room > 0:
                yield rid, t, tokens, lag, room

    def draft_room(self, t: TrackedRequest, num_new: int, *, stopped: bool,
                   in_flight: int = 0) -> int:
        """How many drafts a request may get for its next step, having just sampled `num_new`
        tokens (not yet in `t`) with `in_flight` more coming from the step in flight: 0 when
        it stopped or is not `draftable`, else at most K and no more than its max_tokens and
        max_model_len leave room to verify (the step verifying d drafts may emit d + 1
        tokens)."""
        num_output = len(t.token_ids) + num_new + in_flight
        if stopped or not num_new or not draftable(
                t.params, num_output_tokens=num_output,
                bad_words_token_ids=t.bad_words_token_ids,
                has_grammar=t.params.structured_outputs is not None):
            return 0
        room = self.max_model_len - len(t.prompt_token_ids) - num_output - 1
        if t.params.max_tokens is not None:
            room = min(room, t.params.max_tokens - num_output - 1)
        return min(self.config.num_speculative_tokens, room)

    def propose_tokens(self, token_ids: Sequence[int], k: int) -> list[int]:
        """The method's drafts (at most k) after a request's tokens (prompt + outputs)."""
        cfg = self.config
        return propose_ngram(token_ids, min_n=cfg.prompt_lookup_min,
                             max_n=cfg.prompt_lookup_max, k=k)

    def _until_stop(self, t: TrackedRequest, token_ids: Sequence[int]) -> int:
        """How many of `token_ids` (the request's next outputs) it keeps: through the first
        that finishes it, by the scheduler's own check (`scheduler.check_stop`)."""
        num_prompt = len(t.prompt_token_ids)
        num_tokens = num_prompt + len(t.token_ids)
        for i, token in enumerate(token_ids):
            status, _ = check_stop(t.params, num_prompt, self.eos_token_id, num_tokens + i + 1,
                                   token, self.max_model_len)
            if status is not None:
                return i + 1
        return len(token_ids)


def tokens_in_flight(in_flight: SchedulerOutput | None, request_id: str) -> int | None:
    """Tokens the step in flight samples for a request before drafts proposed now are
    verified: 0 (none, or the synchronous loop), 1 (a plain decode: the proposal follows its
    token, guessed), or None when that step verifies the request's drafts (no proposal now:
    the engine finishes that step before the next plan, and proposes then)."""
    if in_flight is None or request_id not in in_flight.sampling_req_ids:
        return 0
    return None if request_id in in_flight.scheduled_spec_decode_tokens else 1
