"""The model's device batch: a registered pytree of fixed-shape int32 arrays (docs/DESIGN.md).

T is the token bucket (scheduled tokens, padding after), R the fixed request capacity
(`max_num_seqs`). Sampling arrays are the engine's and live elsewhere. A model of several KV
cache groups (jaxengine/model/kv_groups.py) is given each group's block tables and slots,
G of them, and runs on the cache in the groups' layout; with one group the batch is the same
without them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelBatch:
    """Inputs of one model step; all int32, all device (or numpy) arrays."""

    input_ids: jax.Array  # i32[T]  scheduled tokens of all requests, concatenated; padding after
    positions: jax.Array  # i32[T]  position of each token in its request
    slot_mapping: jax.Array  # i32[T]  flat KV slot (block * L + offset); padding -> block 0
    block_tables: jax.Array  # i32[R, max_blocks]  pages of each request; unused entries 0
    seq_lens: jax.Array  # i32[R]  KV length after this step (0 for padding requests)
    query_start_loc: jax.Array  # i32[R+1]  prefix sums of scheduled tokens
    num_seqs: jax.Array  # i32[]  live requests; rows past it are padding
    logits_indices: jax.Array  # i32[R]  last scheduled token of each request
    # i32[G, R, max_blocks] and i32[G, T]: per KV cache group (G > 1), each request's pages
    # and each token's slot, group 0's being `block_tables` and `slot_mapping`; None: the
    # cache is one slot per layer and every layer reads those two
    group_block_tables: jax.Array | None = None
    group_slot_mapping: jax.Array | None = None
    # i32[T]: each token's LoRA adapter slot (0: the base model; padding 0), read with the
    # slots the step is given (jaxengine/model/lora.py); None: a model run without LoRA
    lora_slots: jax.Array | None = None


def requests_of_step(batch: ModelBatch) -> ModelBatch:
    """`batch` with its request rows cut to the T it can hold: every live request schedules a
    token, so rows past T are padding whatever R is. The attention metadata then costs a
    step of few tokens little (each layer shifts the block table by its first page, which at
    R = 128 rows is a measurable share of a one-token step: docs/BENCHMARKS.md §2, "Other work
    in a step"). `logits_indices` keeps R rows
    (the sampler's shapes do not depend on T)."""
    T, R = batch.input_ids.shape[0], batch.seq_lens.shape[0]
    if T >= R:
        return batch
    groups = batch.group_block_tables
    return dataclasses.replace(batch, block_tables=batch.block_tables[:T],
                               seq_lens=batch.seq_lens[:T],
                               query_start_loc=batch.query_start_loc[:T + 1],
                               group_block_tables=None if groups is None else groups[:, :T])


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RequestChunk:
    """Host description of one request's scheduled tokens, for `pack_batch`."""

    token_ids: Sequence[int]  # the tokens scheduled this step
    start: int  # tokens of this request already in the KV cache (position of token_ids[0])
    block_table: Sequence[int]  # the request's pages, in order
    # per KV cache group its table (group 0's is block_table), all as long; None: one group
    group_block_tables: Sequence[Sequence[int]] | None = None


def pack_batch(chunks: Sequence[RequestChunk], *, num_tokens: int, max_seqs: int,
               max_blocks: int, block_size: int, num_groups: int = 1) -> ModelBatch:
    """Pack request chunks into a padded numpy `ModelBatch` of fixed shapes.

    Args:
        chunks: the live requests, in batch order.
        num_tokens: T, the token bucket (>= total scheduled tokens).
        max_seqs: R, the request capacity (>= len(chunks)).
        max_blocks: width of `block_tables`.
        block_size: L, tokens per page.
        num_groups: G, the model's KV cache groups; above 1 each chunk gives G tables and
            the batch carries `group_block_tables` and `group_slot_mapping`.
    Returns:
        A ModelBatch of numpy int32 arrays.
    """
    if num_groups > 1:
        return _pack_groups(chunks, num_tokens=num_tokens, max_seqs=max_seqs,
                            max_blocks=max_blocks, block_size=block_size, num_groups=num_groups)
    total = sum(len(c.token_ids) for c in chunks)
    if total > num_tokens or len(chunks) > max_seqs:
        raise ValueError(f"{total} tokens / {len(chunks)} requests exceed the bucket "
                         f"num_tokens={num_tokens}, max_seqs={max_seqs}")
    ids, pos, slots = (np.zeros(num_tokens, np.int32) for _ in range(3))
    tables = np.zeros((max_seqs, max_blocks), np.int32)
    seq_lens, logits_idx = np.zeros(max_seqs, np.int32), np.zeros(max_seqs, np.int32)
    qsl = np.zeros(max_seqs + 1, np.int32)
    t = 0
    for r, c in enumerate(chunks):
        n = len(c.token_ids)
        p = np.arange(c.start, c.start + n)
        table = np.asarray(c.block_table, np.int32)
        if (c.start + n + block_size - 1) // block_size > len(table) or len(table) > max_blocks:
            raise ValueError(f"request {r}: block table of {len(table)} pages does not fit "
                             f"{c.start + n} tokens (block_size={block_size}, "
                             f"max_blocks={max_blocks})")
        ids[t:t + n], pos[t:t + n] = c.token_ids, p
        slots[t:t + n] = table[p // block_size] * block_size + p % block_size
        tables[r, :len(table)] = table
        seq_lens[r], t = c.start + n, t + n
        qsl[r + 1], logits_idx[r] = t, t - 1
    qsl[len(chunks) + 1:] = t
    return ModelBatch(input_ids=ids, positions=pos, slot_mapping=slots, block_tables=tables,
                      seq_lens=seq_lens, query_start_loc=qsl,
                      num_seqs=np.asarray(len(chunks), np.int32), logits_indices=logits_idx)


def _pack_groups(chunks: Sequence[RequestChunk], *, num_tokens: int, max_seqs: int,
                 max_blocks: int, block_size: int, num_groups: int) -> ModelBatch:
    """`pack_batch` for G > 1 KV cache groups: group 0 as one group, then every group's."""
    batch = pack_batch(chunks, num_tokens=num_tokens, max_seqs=max_seqs,
                       max_blocks=max_blocks, block_size=block_size)
    tables = np.zeros((num_groups, max_seqs, max_blocks), np.int32)
    slots = np.zeros((num_groups, num_tokens), np.int32)
    t = 0
    for r, c in enumerate(chunks):
        n = len(c.token_ids)
        if c.group_block_tables is None or len(c.group_block_tables) != num_groups:
            raise ValueError(f"request {r}: needs block tables for {num_groups} KV cache "
                             f"groups, got {c.group_block_tables!r}")
        p = np.arange(c.start, c.start + n)
        for g, group_table in enumerate(c.group_block_tables):
            table = np.asarray(group_table, np.int32)
            if len(table) != len(c.block_table):
                raise ValueError(f"request {r}: group {g}'s table has {len(table)} pages, "
                                 f"group 0's {len(c.block_table)}")
            tables[g, r, :len(table)] = table
            slots[g, t:t + n] = table[p // block_size] * block_size + p % block_size
        t += n
    return dataclasses.replace(batch, group_block_tables=tables, group_slot_mapping=slots)
