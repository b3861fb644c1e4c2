"""Concurrent partial prefill limits (docs/SCHEDULING.md §6, from older vLLM), on when
`max_num_partial_prefills > 1`.

A *partial prefill* is a request with more than one known token left to compute. Per step at most
`P = max_num_partial_prefills` of them are scheduled, each gets at most
`max_num_batched_tokens // min(P, prefills that could be scheduled)` tokens, and at most
`max_long_partial_prefills` of them may be *long* (more than `long_prefill_token_threshold` tokens
left). A long waiting request over that limit is skipped for the step but keeps its place.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class PartialPrefills:
    """Per-step tracker (lives only inside one schedule() call)."""

    max_prefills: int  # P
    max_long: int
    threshold: int  # "long" means more remaining tokens than this
    slot_budget: int  # most tokens one prefill gets this step
    scheduled: int = 0
    scheduled_long: int = 0

    @classmethod
    def for_step(cls, *, max_prefills: int, max_long: int, threshold: int, batched_tokens: int,
                 running: Sequence[str], waiting: Sequence[str],
                 remaining: Callable[[str], int]) -> "PartialPrefills":
        """Count the prefills that could be scheduled this step to size each one's slot."""
        prefills = longs = 0
        for rid in running:
            left = remaining(rid)
            if left > 1:
                prefills += 1
                longs += left > threshold
        waiting_longs = 0
        for rid in waiting:
            if prefills >= max_prefills:
                break
            if remaining(rid) > threshold:
                if longs + waiting_longs >= max_long:
                    continue  # would be skipped anyway: it takes no slot
                waiting_longs += 1
            prefills += 1
        schedulable = max(1, min(prefills, max_prefills))
        return cls(max_prefills, max_long, threshold, max(1, batched_tokens // schedulable))

    def limit(self, remaining: int, n: int) -> tuple[int, str]:
        """Tokens a prefill with `remaining` tokens left may get (`n` asked for), and why not
        when 0: "full" (P prefills already scheduled) or "long" (too many long ones)."""
        if remaining <= 1:
            return n, ""  # a decode: not a prefill
        if self.scheduled >= self.max_prefills:
            return 0, "full"
        if remaining > self.threshold and self.scheduled_long >= self.max_long:
            return 0, "long"
        return min(n, self.slot_budget), ""

    def record(self, remaining: int) -> None:
        """Count a scheduled request (decodes are not counted)."""
        if remaining > 1:
            self.scheduled += 1
            self.scheduled_long += remaining > self.threshold
