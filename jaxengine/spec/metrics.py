"""Speculative decoding metrics with vLLM's names (`vllm/v1/spec_decode/metrics.py`): what one
step's verification accepted (`SpecDecodingStats`, carried as `IterationStats.spec_decoding`),
and from it the Prometheus counters and the periodic "SpecDecoding metrics" log line.

The counters are made on the first step that verifies drafts (the stat loggers are built without
knowing the engine's `num_speculative_tokens`, which that step's statistics carry); a server that
never speculates exposes none, as vLLM's without a `speculative_config`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter

logger = logging.getLogger("jaxengine.metrics")


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


class SpecDecodingProm:
    """vLLM's `SpecDecodingProm`: drafts, draft tokens, accepted tokens, and accepted tokens
    per draft position (label `position`), per engine replica."""

    def __init__(self, registry: CollectorRegistry, prefix: str, labels: Sequence[str],
                 model_name: str, engine_indexes: Sequence[int], num_spec_tokens: int) -> None:
        """Create the four counters, with a series per replica (and position) at 0."""
        def per_engine(name: str, doc: str) -> dict[int, Counter]:
            family = Counter(prefix + name, doc, labels, registry=registry)
            return {i: family.labels(model_name=model_name, engine=str(i))
                    for i in engine_indexes}

        self.num_drafts = per_engine("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.num_draft_tokens = per_engine("spec_decode_num_draft_tokens",
                                           "Number of draft tokens.")
        self.num_accepted_tokens = per_engine("spec_decode_num_accepted_tokens",
                                              "Number of accepted tokens.")
        per_pos = Counter(prefix + "spec_decode_num_accepted_tokens_per_pos",
                          "Accepted tokens per draft position.", [*labels, "position"],
                          registry=registry)
        self.per_pos = {(i, p): per_pos.labels(model_name=model_name, engine=str(i),
                                               position=str(p))
                        for i in engine_indexes for p in range(num_spec_tokens)}

    def observe(self, stats: SpecDecodingStats, engine_idx: int) -> None:
        """Add one step's verification of replica `engine_idx`."""
        e = engine_idx
        self.num_drafts[e].inc(stats.num_drafts)
        self.num_draft_tokens[e].inc(stats.num_draft_tokens)
        self.num_accepted_tokens[e].inc(stats.num_accepted_tokens)
        for p, n in enumerate(stats.num_accepted_tokens_per_pos):
            self.per_pos[e, p].inc(n)


class SpecDecodingLogging:
    """vLLM's `SpecDecodingLogging`: sums the steps' statistics between two `log` calls."""

    def __init__(self) -> None:
        """Start an empty interval."""
        self._sum: SpecDecodingStats | None = None

    def observe(self, stats: SpecDecodingStats) -> None:
        """Add one step's verification."""
        s = self._sum
        if s is None:
            s = self._sum = SpecDecodingStats(num_spec_tokens=stats.num_spec_tokens)
        s.num_drafts += stats.num_drafts
        s.num_draft_tokens += stats.num_draft_tokens
        s.num_accepted_tokens += stats.num_accepted_tokens
        s.num_accepted_tokens_per_pos = [a + b for a, b in zip(
            s.num_accepted_tokens_per_pos, stats.num_accepted_tokens_per_pos, strict=True)]

    def log(self, elapsed: float) -> str | None:
        """Log the interval's line (None, and nothing logged, if it verified no drafts), then
        start a new interval. `elapsed`: the interval's seconds, for the throughputs."""
        s, self._sum = self._sum, None
        if s is None or not s.num_drafts:
            return None
        rates = ", ".join(f"{n / s.num_drafts:.3f}" for n in s.num_accepted_tokens_per_pos)
        per_s = 1 / elapsed if elapsed > 0 else 0.0
        message = (f"SpecDecoding metrics: Mean acceptance length: "
                   f"{1 + s.num_accepted_tokens / s.num_drafts:.2f}, "
                   f"Accepted throughput: {s.num_accepted_tokens * per_s:.2f} tokens/s, "
                   f"Drafted throughput: {s.num_draft_tokens * per_s:.2f} tokens/s, "
                   f"Accepted: {s.num_accepted_tokens} tokens, "
                   f"Drafted: {s.num_draft_tokens} tokens, "
                   f"Per-position acceptance rate: {rates}, "
                   f"Avg Draft acceptance rate: "
                   f"{100 * s.num_accepted_tokens / max(s.num_draft_tokens, 1):.1f}%")
        logger.info(message)
        return message
