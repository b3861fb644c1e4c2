"""The model's device batch: a registered pytree of fixed-shape int32 arrays (docs/DESIGN.md).

T is the token bucket (scheduled tokens, padding after), R the fixed request capacity
(`max_num_seqs`). Sampling arrays are the engine's and live elsewhere.
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
    return dataclasses.replace(batch, block_tables=batch.block_tables[:T],
                               seq_lens=batch.seq_lens[:T],
                               query_start_loc=batch.query_start_loc[:T + 1])


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RequestChunk:
    """Host description of one request's scheduled tokens, for `pack_batch`."""

    token_ids: Sequence[int]  # the tokens scheduled this step
    start: int  # tokens of this request already in the KV cache (position of token_ids[0])
    block_table: Sequence[int]  # the request's pages, in order


def pack_batch(chunks: Sequence[RequestChunk], *, num_tokens: int, max_seqs: int,
               max_blocks: int, block_size: int) -> ModelBatch:
    """Pack request chunks into a padded numpy `ModelBatch` of fixed shapes.

    Args:
        chunks: the live requests, in batch order.
        num_tokens: T, the token bucket (>= total scheduled tokens).
        max_seqs: R, the request capacity (>= len(chunks)).
        max_blocks: width of `block_tables`.
        block_size: L, tokens per page.
    Returns:
        A ModelBatch of numpy int32 arrays.
    """
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
