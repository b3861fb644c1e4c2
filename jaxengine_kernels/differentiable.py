"""Ragged paged attention with static trip counts: the formulation reverse mode runs, whose VJP
is the backward of every implementation (``jaxengine_kernels.gradients``).

The reference (``jaxengine_kernels.reference``) sizes its loops by the live work, which reverse
mode refuses; this runs the reference's items and chunk steps over every possible item and
every chunk of a block table, masked, so its cost follows the shapes. The layout is the
reference's (its module docstring).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxengine_kernels.reference import (
    DEFAULT_BLOCK_Q,
    DEFAULT_KV_TOKENS_PER_CHUNK,
    attend_item,
    item_rows,
    live_q_lens,
    work_items,
    write_kv,
)


def ragged_paged_attention_differentiable(
    q: jax.Array,  # [T, N, H]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    kv_cache: jax.Array,  # [P, L, 2*K, H]
    slot_mapping: jax.Array,  # i32[T]
    block_tables: jax.Array,  # i32[R, max_blocks]
    seq_lens: jax.Array,  # i32[R]
    query_start_loc: jax.Array,  # i32[R+1]
    num_seqs: jax.Array,  # i32[]
    *,
    sm_scale: float,
    sliding_window: jax.Array | int = 0,
    soft_cap: float | None = None,
    k_scale: jax.Array | float = 1.0,
    v_scale: jax.Array | float = 1.0,
    block_q: int = DEFAULT_BLOCK_Q,
    pages_per_chunk: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The reference's maths with static trip counts, which reverse mode runs: the formulation
    whose VJP is every implementation's backward (``jaxengine_kernels.attention``).

    Arguments and results as ``ragged_paged_attention_reference``'s (a cache of real values:
    no uint8 bits). Every live request, decodes included, is cut into items of Bq tokens; a
    scan runs the most items T tokens in R requests can make, and each item a scan over every
    chunk of its block table, masked (keys too, NaN-safe under reverse mode) and recomputed in
    the backward (``jax.checkpoint``): the backward stores an item's online-softmax state per
    chunk, never a [T, context] array of scores. Bq is ``block_q`` or the mean tokens per
    request slot, ``ceil(T / min(R, T))``, if fewer, so the items hold about 2T rows at most,
    whatever the mix of decodes and prefills. The cost follows the shapes (``T``,
    ``max_blocks``), not the live work: this is for gradients. Padding rows of ``out`` are
    zeros.
    """
    T, N, H = q.shape
    L = kv_cache.shape[1]
    R = block_tables.shape[0]
    C = pages_per_chunk or max(1, DEFAULT_KV_TOKENS_PER_CHUNK // L)
    Bq = min(block_q, -(-T // min(R, T)))
    window = jnp.asarray(sliding_window, jnp.int32)
    scales = (jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32))
    kv_cache = write_kv(kv_cache, k, v, slot_mapping, *scales)
    # Reads gather from a float32 view (a copy for a quantized cache), so that the cotangents
    # of what the items read add up in float32 and round to the cache's dtype once.
    view = kv_cache.astype(jnp.float32)
    cum, _ = work_items(live_q_lens(query_start_loc, num_seqs), Bq, decodes=True)
    # Each live request (at most min(R, T) of them) adds at most Bq - 1 rows of a partial item:
    # at most T / Bq + min(R, T) items, of T + min(R, T) * (Bq - 1) rows.
    n_items = (T + min(R, T) * (Bq - 1)) // Bq
    q_pad = jnp.pad(q, ((0, Bq), (0, 0), (0, 0)))

    def item(i: jax.Array) -> tuple[jax.Array, jax.Array]:
        r, start, in_item, q_pos = item_rows(i, cum, query_start_loc, seq_lens, Bq)
        # An item past the last reads no key: a padding request's table may point at NaN.
        seq_len = jnp.where(in_item[0], seq_lens[r], 0)
        o = attend_item(lax.dynamic_slice_in_dim(q_pad, start, Bq), q_pos, view,
                         block_tables[r], seq_len, window, scales, sm_scale=sm_scale,
                         soft_cap=soft_cap, pages_per_chunk=C, values=view.dtype,
                         static_trips=True)  # fmt: skip
        return o, jnp.where(in_item, start + jnp.arange(Bq, dtype=jnp.int32), T)

    outs, rows = lax.map(item, jnp.arange(n_items, dtype=jnp.int32))  # [I, Bq, N, H], [I, Bq]
    out = jnp.zeros((T, N, H), jnp.float32).at[rows.reshape(-1)].set(
        outs.reshape(-1, N, H), mode="drop")
    return out.astype(q.dtype), kv_cache
