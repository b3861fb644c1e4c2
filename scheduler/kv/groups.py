"""KV cache groups of a hybrid model: full attention or a sliding window (docs/SCHEDULING.md §13).

A group's layers share block tables; one pool serves every group, a pool block one group at a
time. What is specific to a sliding window lives here as pure functions of plain numbers: the
blocks that slid out of it, the prefix hit it supports, the most blocks it holds at once, and
from those the pool's maximum concurrency (vLLM's startup line).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scheduler.kv.hashing import BlockHash

CacheKey = BlockHash | tuple[int, BlockHash]  # what a block is registered under in the cache


@dataclass(frozen=True, slots=True, kw_only=True)
class KVCacheGroup:
    """One KV cache group: layers of one attention kind whose blocks share a block table.

    Raises:
        ValueError: `sliding_window` or `num_layers` below 1, or not an int (named with its
            value).
    """

    sliding_window: int | None = None  # tokens a query sees, itself included; None: all
    num_layers: int = 1  # layers a block of the group holds (byte accounting only)

    def __post_init__(self) -> None:
        for name in ("sliding_window", "num_layers"):
            value = getattr(self, name)
            if value is None and name == "sliding_window":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVCacheGroup: {name}={value!r} must be an int >= 1")


FULL_ATTENTION = KVCacheGroup()  # the one group of a model without windows


def one_full_group(groups: Sequence[KVCacheGroup]) -> bool:
    """Whether `groups` is a single full-attention group, of any size (the scheduler of the
    sections before §13; `num_layers` only counts bytes)."""
    return len(groups) == 1 and groups[0].sliding_window is None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_key(group: int, block_hash: BlockHash) -> CacheKey:
    """The prefix-cache key of a block of `group` holding `block_hash`: the hash itself for
    group 0 (so a model with one group caches as before), `(group, hash)` for the others."""
    return block_hash if group == 0 else (group, block_hash)


def num_skipped_blocks(window: int, num_computed: int, block_size: int) -> int:
    """Leading blocks whose tokens all lie outside the window of every token from
    `num_computed` on (vLLM's `get_num_skipped_tokens // block_size`)."""
    return max(0, num_computed - window + 1) // block_size


def max_group_blocks(group: KVCacheGroup, num_tokens: int, block_size: int,
                     num_new_tokens: int) -> int:
    """The most blocks `group` holds at once for a sequence of `num_tokens` tokens computed
    at most `num_new_tokens` per step: all of them for full attention; for a window, the window
    plus one step's tokens, plus one block for misalignment (vLLM's `max_memory_usage_bytes`),
    never more than the sequence has."""
    total = cdiv(num_tokens, block_size)
    w = group.sliding_window
    if w is None:
        return total
    return min(total, cdiv(min(w - 1 + num_new_tokens, num_tokens), block_size) + 1)


def kv_block_layers(groups: Sequence[KVCacheGroup]) -> int:
    """Layers one pool block holds KV for: the most of any group (smaller groups leave the
    rest of their blocks unused, as vLLM pads them). A block's bytes are this times one
    layer's `block_size` tokens of K and V."""
    return max(g.num_layers for g in groups)


def max_concurrency(groups: Sequence[KVCacheGroup], *, num_blocks: int, block_size: int,
                    num_tokens: int, max_num_batched_tokens: int) -> float:
    """How many requests of `num_tokens` tokens the pool holds at once (vLLM's "Maximum
    concurrency for N tokens per request: X").

    Args:
        groups: the KV cache groups.
        num_blocks: blocks in the pool, the null block included (`SchedulerConfig.num_blocks`).
        block_size: tokens per block.
        num_tokens: the tokens of each request.
        max_num_batched_tokens: the most tokens one request computes in a step (1: decoding).
    Returns:
        Usable blocks over the blocks one request holds at most (`max_group_blocks` summed).
    """
    per_request = sum(max_group_blocks(g, num_tokens, block_size, max_num_batched_tokens)
                      for g in groups)
    return (num_blocks - 1) / per_request


def longest_hit(cached: Mapping[CacheKey, tuple[int, ...]], hashes: Sequence[BlockHash],
                windows: Sequence[int | None], block_size: int) -> tuple[tuple[int, ...], ...]:
    """The prefix hit all groups agree on (vLLM's `HybridKVCacheCoordinator`), per group.

    Args:
        cached: the prefix cache, key (`group_key`) -> blocks holding it.
        hashes: the request's hittable block hashes, in order.
        windows: each group's sliding window (None: full attention).
        block_size: tokens per block.
    Returns:
        Per group, the hit's blocks: the same count `L` in every group; in a sliding group the
        first `num_skipped_blocks(W, L * block_size)` are the null block 0.
    """
    length = len(hashes)
    while True:
        agreed = min(_supported(cached, hashes, g, w, length, block_size)
                     for g, w in enumerate(windows))
        if agreed == length:
            break
        length = agreed
    hit = []
    for g, w in enumerate(windows):
        skip = 0 if w is None else min(length, num_skipped_blocks(w, length * block_size,
                                                                  block_size))
        hit.append((0,) * skip + tuple(cached[group_key(g, hashes[i])][0]
                                       for i in range(skip, length)))
    return tuple(hit)


def _supported(cached: Mapping[CacheKey, tuple[int, ...]], hashes: Sequence[BlockHash],
               group: int, window: int | None, length: int, block_size: int) -> int:
    """The longest hit within `length` blocks that `group` alone supports."""
    if window is None:
        n = 0
        while n < length and group_key(group, hashes[n]) in cached:
            n += 1
        return n
    # The last hit token's window needs its k blocks before the hit's end (vLLM searches
    # right to left); with no such run, the cached run from block 0 (shorter than k).
    k = cdiv(window - 1, block_size)
    run = 0
    for i in range(length - 1, -1, -1):
        if group_key(group, hashes[i]) in cached:
            run += 1
            if run >= k:
                return i + run
        else:
            run = 0
    return run
