"""The paged KV block pool and per-request block tables, with automatic prefix caching
(docs/SCHEDULING.md §5).

`PoolData` is the mutable data; `KVCacheManager` is a working view that mutates it only through a
`Journal`, so `scheduler._versioned` can keep every old version alive (purity at the boundary).

Free queue: a doubly linked list over block ids (arrays `nxt`/`prv` with two sentinels), so that
taking a cached block off the middle (a prefix hit) is O(1). Allocation takes from the head.
Freeing releases a request's blocks tail first; a block with no cached hash goes to the head
(reused first), a cached one to the tail (evicted last): LRU eviction, suffix before prefix.
Block 0 is the null block: never allocated, freed or counted.

A hybrid model's KV cache groups (docs/SCHEDULING.md §13) share the pool: a request has one
table per group, all of one length; a sliding group's table holds the null block where its
window has moved past, and each group caches its blocks under its own keys
(`groups.group_key`). With one full-attention group every method does what it did alone.
"""

import itertools
from collections.abc import Iterable, Mapping, Sequence

from scheduler._versioned import Journal
from scheduler.kv.groups import (
    CacheKey,
    KVCacheGroup,
    group_key,
    longest_hit,
    max_group_blocks,
    num_skipped_blocks,
    one_full_group,
)
from scheduler.kv.groups import cdiv as cdiv
from scheduler.kv.hashing import BlockHash, extend_block_hashes


def num_hittable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading blocks of a request of `num_tokens` tokens may come from the prefix
    cache: full blocks only, and never its last token (it is computed, to produce logits)."""
    return (num_tokens - 1) // block_size


def longest_cached_prefix(cached: Mapping[CacheKey, tuple[int, ...]],
                          hashes: Iterable[BlockHash]) -> list[int]:
    """The first block holding each of `hashes`, in order, up to the first one not cached."""
    hit: list[int] = []
    for h in hashes:
        blocks = cached.get(h)
        if blocks is None:
            break
        hit.append(blocks[0])
    return hit


class PoolData:
    """All mutable KV bookkeeping of one scheduler lineage (changed only through a `Journal`).

    Block tables are not here: they are per-request tuples in the scheduler state (a table only
    changes when a block is appended, and the model runner reads them every step)."""

    __slots__ = ("head", "tail", "ref", "block_hash", "nxt", "prv", "num_free", "cached",
                 "req_hashes")

    def __init__(self, num_blocks: int) -> None:
        n = num_blocks
        self.head, self.tail = n, n + 1  # sentinel indices in nxt/prv
        self.ref: list[int] = [0] * n  # reference count per block
        self.block_hash: list[CacheKey | None] = [None] * n  # registered key per block
        # Free list 1, 2, ..., n-1 between the sentinels (block 0 is the null block).
        self.nxt: list[int] = [i + 1 for i in range(n)] + [1, -1]
        self.prv: list[int] = [i - 1 for i in range(n)] + [-1, n - 1]
        self.nxt[n - 1] = self.tail
        if n == 1:
            self.nxt[self.head], self.prv[self.tail] = self.tail, self.head
        else:
            self.prv[1] = self.head
        self.num_free: int = n - 1  # blocks in the free list (written with Journal.set_attr)
        self.cached: dict[CacheKey, tuple[int, ...]] = {}  # key -> blocks holding it
        self.req_hashes: dict[str, list[BlockHash]] = {}  # lazily computed full-block hashes

    def free_list(self) -> list[int]:
        """The free queue, head first (for tests and invariants)."""
        out, b = [], self.nxt[self.head]
        while b != self.tail:
            out.append(b)
            b = self.nxt[b]
        return out

    def content(self) -> tuple:
        """What this pool holds, as immutable values, for comparing states: the free queue, the
        reference counts, each block's hash and the prefix-cache map. Left out because they
        change no result: the stale links of allocated blocks and the memo of request hashes."""
        return (tuple(self.free_list()), tuple(self.ref), tuple(self.block_hash),
                dict(self.cached))


Table = tuple[int, ...]
Hit = tuple[tuple[int, ...], ...]  # a prefix hit's blocks, per group (null 0 where skipped)


class KVCacheManager:
    """Allocation, freeing and prefix caching over one edit of `PoolData`, for every KV cache
    group: methods take and return a request's tables as a tuple, one per group."""

    __slots__ = ("d", "j", "block_size", "caching", "max_model_len", "evicted", "groups",
                 "windows", "hybrid", "empty", "step_tokens")

    def __init__(self, data: PoolData, journal: Journal, *, block_size: int, caching: bool,
                 max_model_len: int, groups: tuple[KVCacheGroup, ...],
                 step_tokens: int) -> None:
        self.d, self.j = data, journal
        self.block_size = block_size
        self.caching = caching
        self.max_model_len = max_model_len
        self.groups = groups
        # Anything but one full group: tables per group, windows to slide (docs §13)
        self.hybrid = not one_full_group(groups)
        self.windows = tuple(g.sliding_window for g in groups) if self.hybrid else (None,)
        self.empty: Hit = ((),) * len(groups)  # no blocks in any group (no hit, no table)
        self.step_tokens = step_tokens  # the most tokens a request computes in one step
        # When a list: every cached block that allocation evicts, as (block, hash), for a KV
        # connector to copy out before the step overwrites it (docs/SCHEDULING.md §11).
        self.evicted: list[tuple[int, CacheKey]] | None = None

    @property
    def num_free(self) -> int:
        """Free blocks, cached ones included (they are evictable)."""
        return self.d.num_free

    # ---- prefix cache -------------------------------------------------------------------

    def find_cached_prefix(self, rid: str, tokens: Sequence[int], num_tokens: int,
                           salt: str | None, lora_name: str | None) -> Hit:
        """Per group, the blocks holding the longest cached prefix all groups agree on, at
        most `num_tokens - 1` tokens long (the last token is always computed, for logits)."""
        if not self.caching:
            return self.empty
        # All the hashes at once: admitting the request registers them right after anyway.
        count = num_hittable_blocks(num_tokens, self.block_size)
        hashes = itertools.islice(self._hashes(rid, tokens, count, salt, lora_name), count)
        if self.hybrid:
            return longest_hit(self.d.cached, tuple(hashes), self.windows, self.block_size)
        return (tuple(longest_cached_prefix(self.d.cached, hashes)),)

    def _hashes(self, rid: str, tokens: Sequence[int], count: int,
                salt: str | None, lora_name: str | None) -> list[BlockHash]:
        hashes = self.d.req_hashes.get(rid)
        if hashes is None:
            hashes = []
            self.j.set_key(self.d.req_hashes, rid, hashes)
        if len(hashes) < count:
            self.j.extend(hashes, extend_block_hashes(hashes, tokens, count, self.block_size,
                                                      salt, lora_name=lora_name))
        return hashes

    def block_hashes(self, rid: str, tokens: Sequence[int], count: int,
                     salt: str | None, lora_name: str | None) -> tuple[BlockHash, ...]:
        """The hashes of the request's first `count` full blocks (computed if not memoized)."""
        return tuple(self._hashes(rid, tokens, count, salt, lora_name)[:count])

    def forget_hashes(self, rid: str) -> None:
        """Drop a finished request's hashes (preempted ones keep them: tokens do not change)."""
        if rid in self.d.req_hashes:
            self.j.delete(self.d.req_hashes, rid)

    def num_blocks_needed(self, tables: tuple[Table, ...], num_slots: int, hit: Hit = (),
                          *, whole: bool = False) -> int:
        """Free blocks that giving a request `num_slots` KV slots would take, summed over the
        groups (hit blocks that sit in the free queue count: taking them removes them from it).
        `whole`: reserve a whole sequence of `num_slots` tokens, of which a sliding group holds
        at most `groups.max_group_blocks` at once (docs/SCHEDULING.md §13)."""
        n = cdiv(min(num_slots, self.max_model_len), self.block_size)
        ref = self.d.ref
        if not self.hybrid:  # the hot case, one full group, without the loop below
            blocks = hit[0] if hit else ()
            return (max(0, n - len(blocks) - len(tables[0]))
                    + sum(1 for b in blocks if ref[b] == 0))
        need = 0
        for g, table in enumerate(tables):
            blocks = hit[g] if hit else ()
            if whole and self.windows[g] is not None:
                cap = max_group_blocks(self.groups[g], min(num_slots, self.max_model_len),
                                       self.block_size, self.step_tokens)
                held = sum(1 for b in table if b) + sum(1 for b in blocks if b)
                need += max(0, cap - held)
            else:
                need += max(0, n - len(blocks) - len(table))
            need += sum(1 for b in blocks if b and ref[b] == 0)
        return need

    # ---- allocation -------------------------------------------------------------------

    def remove_skipped(self, tables: tuple[Table, ...], num_computed: int) -> tuple[Table, ...]:
        """The tables with every block that slid out of its group's window, for all tokens
        from `num_computed` on, freed and replaced by the null block (vLLM's
        `remove_skipped_blocks`; later blocks are freed first)."""
        out = list(tables)
        for g, w in enumerate(self.windows):
            if w is None:
                continue
            t = tables[g]
            n = min(num_skipped_blocks(w, num_computed, self.block_size), len(t))
            i = n
            while i > 0 and t[i - 1]:  # the nulls before i were freed by earlier calls
                i -= 1
            if i < n:
                self.free(t[i:n])
                out[g] = (0,) * n + t[n:]
        return tuple(out)

    def allocate(self, tables: tuple[Table, ...], num_slots: int,
                 hit: Hit = ()) -> tuple[Table, ...] | None:
        """The tables grown to `num_slots` slots (a new request's `hit` blocks first), or
        None, changing nothing, if the pool is short."""
        if self.num_blocks_needed(tables, num_slots, hit) > self.num_free:
            return None
        d, j = self.d, self.j
        # Every group's hit leaves the free queue before any group takes from it.
        for blocks in hit:
            for b in blocks:
                if b:
                    if d.ref[b] == 0:
                        self._unlink(b)
                    j.set_item(d.ref, b, d.ref[b] + 1)
        n = cdiv(min(num_slots, self.max_model_len), self.block_size)
        if not self.hybrid:  # the hot case, one full group, without the loop below
            table = tables[0] + hit[0] if hit else tables[0]
            return (table + tuple(self._take_free(n - len(table))) if n > len(table) else table,)
        out = []
        for g, table in enumerate(tables):
            if hit:
                table = table + hit[g]
            if n > len(table):
                table += tuple(self._take_free(n - len(table)))
            out.append(table)
        return tuple(out)

    def register(self, rid: str, tables: tuple[Table, ...], num_cached: int, num_full: int,
                 tokens: Sequence[int], salt: str | None, lora_name: str | None) -> None:
        """Register the hashes of each table's blocks num_cached..num_full-1 (now full) under
        its group's keys; a null entry registers nothing."""
        d, j = self.d, self.j
        hashes = self._hashes(rid, tokens, num_full, salt, lora_name)
        for g, table in enumerate(tables):
            for i in range(num_cached, num_full):
                b = table[i]
                if b:
                    h = group_key(g, hashes[i])
                    j.set_item(d.block_hash, b, h)
                    j.set_key(d.cached, h, d.cached.get(h, ()) + (b,))

    def free_tables(self, tables: tuple[Table, ...]) -> None:
        """Release a request's blocks in every group, group by group, each as `free` does."""
        for table in tables:
            self.free([b for b in table if b] if self.hybrid else table)

    def free(self, table: Sequence[int]) -> None:
        """Release a request's blocks, tail first: each block nobody else holds goes to the
        head of the free queue if it has no cached hash (reused first), else to the tail."""
        d, j = self.d, self.j
        to_head, to_tail = [], []
        for b in reversed(table):
            ref = d.ref[b] - 1
            j.set_item(d.ref, b, ref)
            if ref == 0:
                (to_head if d.block_hash[b] is None else to_tail).append(b)
        # Pushing u1, u2, ... one by one to the head leaves ..., u2, u1 first: splice reversed.
        if to_head:
            to_head.reverse()
            self._splice(to_head, d.head, d.nxt[d.head])
        if to_tail:
            self._splice(to_tail, d.prv[d.tail], d.tail)

    # ---- the free queue -----------------------------------------------------------------
    def _take_free(self, n: int) -> list[int]:
        """Pop n blocks off the head, evicting their cached hashes."""
        d, j = self.d, self.j
        taken, b = [], d.nxt[d.head]
        for _ in range(n):
            taken.append(b)
            b = d.nxt[b]
        j.set_item(d.nxt, d.head, b)
        j.set_item(d.prv, b, d.head)
        j.set_attr(d, "num_free", d.num_free - n)
        for b in taken:
            j.set_item(d.ref, b, 1)
            h = d.block_hash[b]
            if h is not None:
                if self.evicted is not None:
                    self.evicted.append((b, h))
                self._evict(b, h)
        return taken

    def _evict(self, b: int, h: CacheKey) -> None:
        d, j = self.d, self.j
        rest = tuple(x for x in d.cached[h] if x != b)
        if rest:
            j.set_key(d.cached, h, rest)
        else:
            j.delete(d.cached, h)
        j.set_item(d.block_hash, b, None)

    def _unlink(self, b: int) -> None:
        d, j = self.d, self.j
        p, n = d.prv[b], d.nxt[b]
        j.set_item(d.nxt, p, n)
        j.set_item(d.prv, n, p)
        j.set_attr(d, "num_free", d.num_free - 1)

    def _splice(self, chain: list[int], p: int, n: int) -> None:
        """Link `chain` (in order) between the adjacent free-list nodes p and n."""
        d, j = self.d, self.j
        prev = p
        for b in chain:
            j.set_item(d.prv, b, prev)
            j.set_item(d.nxt, prev, b)
            prev = b
        j.set_item(d.nxt, prev, n)
        j.set_item(d.prv, n, prev)
        j.set_attr(d, "num_free", d.num_free + len(chain))
