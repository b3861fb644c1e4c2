"""Shape buckets: token counts for the model step, request counts for the sampler."""

from __future__ import annotations

from collections.abc import Sequence


def _powers_of_two_up_to(start: int, maximum: int) -> tuple[int, ...]:
    sizes, size = [], start
    while size < maximum:
        sizes.append(size)
        size *= 2
    return (*sizes, maximum)


# The smallest token bucket, as vLLM's capture sizes start at 1: a step of one or a few decodes
# costs far less in a small bucket (SmolLM2 f32 on the 2-core CPU, one live decode, CPU ms per
# step: see docs/BENCHMARKS.md §3 for the table and the choice).
SMALLEST_TOKEN_BUCKET = 1


def token_buckets(max_num_batched_tokens: int, *, smallest: int = SMALLEST_TOKEN_BUCKET,
                  intermediate: bool = False) -> tuple[int, ...]:
    """Powers of two from `smallest` below `max_num_batched_tokens`, then the maximum itself.

    With `intermediate`, also 1.5x each power of two from 2 on (3, 6, 12, 24, 48, ...): about
    twice the compilations for less padding. docs/BENCHMARKS.md §3 has the measured compile
    time per bucket and the padding cost that chose the default.
    """
    if smallest < 1:
        raise ValueError(f"smallest must be >= 1, got {smallest}")
    sizes = _powers_of_two_up_to(min(smallest, max_num_batched_tokens), max_num_batched_tokens)
    if intermediate:
        extra = {s * 3 // 2 for s in sizes[:-1] if s > 1 and s * 3 // 2 < max_num_batched_tokens}
        sizes = tuple(sorted(set(sizes) | extra))
    return sizes


def request_buckets(max_num_seqs: int, *, smallest: int = 8) -> tuple[int, ...]:
    """Sampler row counts: powers of two from `smallest` below `max_num_seqs`, then it."""
    return _powers_of_two_up_to(min(smallest, max_num_seqs), max_num_seqs)


def pick_bucket(buckets: Sequence[int], n: int) -> int:
    """The smallest bucket holding `n`; `ValueError` if none does."""
    for size in buckets:
        if size >= n:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
