"""vLLM's `SpecDecodingStats`: what one step's verification accepted, for the stat loggers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, kw_only=True)
class SpecDecodingStats:
    """Drafts verified in one step (increments; vLLM's names and meanings)."""

    num_spec_tokens: int  # K, the configured drafts per request (the per-position width)
    num_drafts: int = 0  # requests whose drafts were verified
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    # i: drafts accepted at position i (a request that accepted a drafts counts at 0..a-1)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one request's verification: `num_accepted_tokens` of `num_draft_tokens`."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1
