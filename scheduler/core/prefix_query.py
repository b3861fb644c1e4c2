"""`prefix_cache_hit`: what the prefix cache of a state holds of a request, changing nothing.

A data-parallel router asks each replica's state this before it picks one (a prefix cached on
one replica cannot help a request sent to another). The answer is the one admission would give
if the request were admitted now: the same hashes (`scheduler.kv.hashing`, `cache_salt` on the
first block, the LoRA adapter's name on every one), the same lookup
(`kv_cache.longest_cached_prefix`) and the same cap (`kv_cache.num_hittable_blocks`: the last
token is always computed). Nothing is written: not the state, not its shared data, not the
memo of request hashes. With several KV cache groups the answer is the hit they all agree on
(`groups.longest_hit`, docs/SCHEDULING.md §13).
"""

from collections.abc import Iterator, Sequence

from scheduler.core.state import SchedulerState, StateData
from scheduler.kv.groups import longest_hit
from scheduler.kv.hashing import BlockHash, extend_block_hashes
from scheduler.kv.kv_cache import longest_cached_prefix, num_hittable_blocks
from scheduler.request import Request


def prefix_cache_hit(state: SchedulerState, request: Request) -> int:
    """Tokens of `request` that `state`'s prefix cache would supply were it admitted now.

    Args:
        state: any scheduler state; it is only read.
        request: a request not necessarily in `state` (its prompt, any outputs it arrives
            with, its `cache_salt` and its LoRA adapter are what count).
    Returns:
        A whole number of blocks, in tokens: 0 with prefix caching off or for a request that
        skips reading it (`skip_reading_prefix_cache`: prompt logprobs), and at most
        `(num_tokens - 1) // block_size` blocks.
    """
    cfg = state.config
    if not cfg.enable_prefix_caching or request.skip_reading_prefix_cache:
        return 0
    tokens = request.all_token_ids
    count = num_hittable_blocks(len(tokens), cfg.block_size)
    hashes = _hashes(tokens, count, cfg.block_size, request.cache_salt, request.lora_name)
    windows = tuple(g.sliding_window for g in cfg.kv_cache_groups)

    def lookup(data: StateData) -> int:
        if windows != (None,):  # a sliding group searches from the end: every hash
            return len(longest_hit(data.kv.cached, tuple(hashes), windows,
                                   cfg.block_size)[0])
        return len(longest_cached_prefix(data.kv.cached, hashes))

    return state.read_data(lookup) * cfg.block_size


def _hashes(tokens: Sequence[int], count: int, block_size: int,
            salt: str | None, lora_name: str | None) -> Iterator[BlockHash]:
    """The first `count` block hashes, one at a time: a miss at block i hashes no further."""
    hashes: list[BlockHash] = []
    while len(hashes) < count:
        hashes += extend_block_hashes(hashes, tokens, len(hashes) + 1, block_size, salt,
                                      lora_name=lora_name)
        yield hashes[-1]
