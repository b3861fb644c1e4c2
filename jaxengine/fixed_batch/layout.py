"""A fixed batch on a private paged KV cache: what `generate` and `score` feed the model step.

Row b of a batch of B rows owns M pages of L tokens (never the null page 0, where padding
writes), laid out as `cache` says:

- `"contiguous"`: row b owns pages `1 + b*M ... (b+1)*M`, one contiguous stretch (a `[B, M*L]`
  cache viewed as pages);
- `"paged"`: pages are interleaved across rows (page j of b is `1 + j*B + b`), the scattered
  layout a paged pool produces.
Both give the same results.

A row of width W holds left padding, then its `seq_lens[b]` real tokens (positions 0 ...
seq_lens[b] - 1), which is the attention contract of `jaxengine_kernels.reference` for one
prefill of W tokens per request: padding gets negative positions, attends to nothing that
matters and writes to the null page.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.model.batch import ModelBatch

CACHE_LAYOUTS = ("contiguous", "paged")


def check_layout(cache: str, block_size: int) -> None:
    """ValueError unless `cache` is a known layout and `block_size` a positive int."""
    if cache not in CACHE_LAYOUTS:
        raise ValueError(f"cache must be 'contiguous' or 'paged', got {cache!r}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def check_rows(name: str, ids: Any, lens: Any, vocab_size: int) -> None:
    """ValueError if concrete `ids` i32[B, W] / `lens` i32[B] are out of range.

    Traced values (under the caller's jit) cannot be read, so they pass unchecked.
    """
    if ids.ndim != 2:
        raise ValueError(f"{name} must be 2-D [B, S] (one row per sequence), got shape "
                         f"{tuple(ids.shape)}; encode and pad a batch with "
                         f"jaxengine.encode_batch")
    B, W = ids.shape
    if lens is not None and tuple(lens.shape) != (B,):
        raise ValueError(f"{name} lengths must have shape ({B},), got {tuple(lens.shape)}")
    if isinstance(ids, jax.core.Tracer) or isinstance(lens, jax.core.Tracer):
        return
    host_ids = np.asarray(ids)
    if host_ids.size and (host_ids.min() < 0 or host_ids.max() >= vocab_size):
        raise ValueError(f"{name} must hold token ids in [0, {vocab_size}), got values in "
                         f"[{host_ids.min()}, {host_ids.max()}]")
    if lens is not None:
        host_lens = np.asarray(lens)
        if host_lens.size and (host_lens.min() < 1 or host_lens.max() > W):
            raise ValueError(f"{name} lengths must be in [1, {W}] (the row width), got "
                             f"{host_lens.tolist()}")


def block_tables(B: int, M: int, cache: str) -> jax.Array:
    """i32[B, M] page ids of every row (never the null page 0)."""
    b, j = jnp.arange(B)[:, None], jnp.arange(M)[None, :]
    if cache == "contiguous":
        return (1 + b * M + j).astype(jnp.int32)
    return (1 + j * B + b).astype(jnp.int32)


def pages_per_row(width: int, block_size: int) -> int:
    """M: pages one row of `width` tokens needs."""
    return -(-width // block_size)


def _slots(tables: jax.Array, positions: jax.Array, L: int) -> jax.Array:
    """Flat KV slot of each (row, position); negative positions go to the null page."""
    page = jnp.take_along_axis(tables, jnp.maximum(positions, 0) // L, axis=1)
    return jnp.where(positions >= 0, page * L + positions % L, positions % L)


def prefill(step_fn: Callable, params: Any, kv: jax.Array, ids: jax.Array, seq_lens: jax.Array,
            tables: jax.Array, L: int) -> tuple[jax.Array, jax.Array]:
    """One model step over all rows at once (B*W tokens, left padding).

    Args:
      step_fn: the model step (`ModelFns.step`).
      ids: i32[B, W] rows, real tokens right-aligned. seq_lens: i32[B] real tokens per row.
      tables: i32[B, M] pages of each row. L: tokens per page.
    Returns:
      (kv, hidden [B, W, D]); padding rows of `hidden` are meaningless.
    """
    B, W = ids.shape
    pos = jnp.arange(W)[None, :] - (W - seq_lens)[:, None]  # i32[B, W]; < 0 on padding
    batch = ModelBatch(
        input_ids=ids.reshape(-1).astype(jnp.int32),
        positions=jnp.maximum(pos, 0).reshape(-1).astype(jnp.int32),
        slot_mapping=_slots(tables, pos, L).reshape(-1).astype(jnp.int32),
        block_tables=tables, seq_lens=seq_lens.astype(jnp.int32),
        query_start_loc=(jnp.arange(B + 1) * W).astype(jnp.int32),
        num_seqs=jnp.asarray(B, jnp.int32),
        logits_indices=(jnp.arange(B) * W + W - 1).astype(jnp.int32))
    kv, hidden = step_fn(params, kv, batch)
    return kv, hidden.reshape(B, W, -1)


def decode_batch(tokens: jax.Array, lengths: jax.Array, tables: jax.Array, L: int
                 ) -> ModelBatch:
    """One token per row: `tokens` i32[B] at position `lengths` i32[B] (the context so far)."""
    B = tokens.shape[0]
    ar = jnp.arange(B, dtype=jnp.int32)
    return ModelBatch(
        input_ids=tokens, positions=lengths, slot_mapping=_slots(tables, lengths[:, None], L)[:, 0],
        block_tables=tables, seq_lens=lengths + 1,
        query_start_loc=jnp.arange(B + 1, dtype=jnp.int32), num_seqs=jnp.asarray(B, jnp.int32),
        logits_indices=ar)
