"""Ragged paged attention in pure jnp: the CPU path and the oracle for the Pallas kernels.

Layout assumptions (shared by every implementation in this package):

- Tokens of all scheduled requests are concatenated along T: request r owns rows
  ``query_start_loc[r] : query_start_loc[r + 1]``; rows past ``query_start_loc[num_seqs]`` are
  padding. Their output rows are unspecified (this implementation writes zeros).
- ``kv_cache`` is one layer's pages, ``[P, L, 2*K, H]``: key head ``kh`` at head slot ``2*kh``,
  value head ``kh`` at ``2*kh + 1``. Flat slot ``s`` is page ``s // L``, offset ``s % L``.
- Token t of request r sits at position ``seq_lens[r] - (query_start_loc[r+1] - t)`` and attends
  to the cached positions ``<= `` its own (causal inside the chunk, full over the context); with
  a sliding window W > 0, only to those ``> p - W`` (``first_visible``). Pages wholly before
  every window of a unit of work are skipped, not read and masked: a sliding layer's pages that
  have slid out of the window may already hold another request's data.
- With ``soft_cap``, scores are capped (``cap_scores``) right after ``q.k * sm_scale``.
- The cache may hold another dtype than the queries (``jaxengine_kernels.cache_dtype``): the
  new K/V are written quantized (``x / scale``, fp8 saturating), and every read is
  dequantized, ``cache.astype(float32) * scale``, with per-tensor ``k_scale`` / ``v_scale``.
  An fp8 cache may be a uint8 array of its bits (``kv_cache_dtype`` names the format): the
  new rows are scattered as bytes and only the gathered pages are bitcast back.
- GQA: query head ``n`` reads kv head ``n // G`` with ``G = N // K``.
- Pages a request does not own (and slots past ``seq_lens``) may hold anything, NaN included:
  they are masked with ``jnp.where`` (a multiply by zero would keep a NaN).

Memory stays bounded for long contexts; no ``[T, max_context]`` array is ever built:

- Decodes (requests with one scheduled token) go through one pass over the flat list of their
  live pages (``jaxengine_kernels.decode_pass``): each loop step gathers the next few pages
  (``[W, L, 2*K, H]``, whatever requests they belong to) and folds them into their request's
  online softmax (float32).
- Longer requests (prefill chunks) are cut into items of up to ``block_q`` tokens; a
  ``lax.fori_loop`` over the items walks each item's pages ``pages_per_chunk`` at a time with
  an online softmax. Items and chunk counts are data-dependent trip counts, so the cost follows
  the live work, not ``max_blocks`` or the padding.

Reverse mode refuses those loops; ``differentiable.ragged_paged_attention_differentiable``
runs the same items and chunk steps (``work_items``, ``item_rows``, ``attend_item``) with
static trip counts, masked, and is the backward of every implementation
(``jaxengine_kernels.gradients``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxengine_kernels.cache_dtype import dequantize, from_bits, quantize
from jaxengine_kernels.decode_pass import decode_pass, pages_per_step
from jaxengine_kernels.scores import HIGHEST, cap_scores, first_visible

# Defaults: 128 query tokens per item and 256 cached tokens per online-softmax step, faster on
# CPU at SmolLM2's heads than 64 and 512 (docs/BENCHMARKS.md §4, "Why the jnp reference is as
# it is").
DEFAULT_BLOCK_Q = 128
DEFAULT_KV_TOKENS_PER_CHUNK = 256


def new_rows(
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    dtype: jnp.dtype,
    k_scale: jax.Array | float = 1.0,  # f32[]
    v_scale: jax.Array | float = 1.0,  # f32[]
) -> jax.Array:  # [T, 2*K, H] in dtype
    """The cache rows of the new keys and values: quantized (``cache_dtype.quantize``) and
    interleaved, K at even head slots, V at odd ones."""
    T, K, H = k.shape
    k_q = quantize(k, jnp.asarray(k_scale, jnp.float32), dtype)
    v_q = quantize(v, jnp.asarray(v_scale, jnp.float32), dtype)
    return jnp.stack([k_q, v_q], axis=2).reshape(T, 2 * K, H)


def write_kv(
    kv_cache: jax.Array,  # [P, L, 2*K, H]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    slot_mapping: jax.Array,  # i32[T]
    k_scale: jax.Array | float = 1.0,  # f32[]
    v_scale: jax.Array | float = 1.0,  # f32[]
    *,
    kv_cache_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """Scatter the new keys/values into the cache at their flat slots, quantized.

    The cache holds ``k / k_scale`` and ``v / v_scale`` in its dtype, clipped to the finite
    range first for fp8, so that values beyond it saturate instead of becoming inf or NaN
    (``jaxengine_kernels.cache_dtype.quantize``). A uint8 cache holds the bits of
    ``kv_cache_dtype`` (fp8) values: the new rows alone are bitcast to bytes, and the scatter
    into a donated uint8 cache is in place (``cache_dtype.storage_dtype``).

    Returns:
      The updated cache, ``[P, L, 2*K, H]``, same dtype. Padding tokens write into block 0,
      which no request reads.
    """
    P, L, K2, H = kv_cache.shape
    if k.shape[0] == 1:
        # XLA on CPU makes a one-row scatter a fusion it duplicates, copying the whole cache
        # several times a layer (docs/BENCHMARKS.md §3); a second row that writes into the null
        # block 0 keeps it in place.
        k, v = (jnp.concatenate([x, jnp.zeros_like(x)]) for x in (k, v))
        slot_mapping = jnp.concatenate([slot_mapping, jnp.zeros_like(slot_mapping)])
    kv_new = new_rows(k, v, kv_cache_dtype or kv_cache.dtype, k_scale, v_scale)
    if kv_new.dtype != kv_cache.dtype:  # fp8 values into a cache of their bits
        kv_new = lax.bitcast_convert_type(kv_new, kv_cache.dtype)
    flat = kv_cache.reshape(P * L, K2, H).at[slot_mapping].set(kv_new, mode="drop")
    return flat.reshape(P, L, K2, H)


def live_q_lens(query_start_loc: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """i32[R] scheduled tokens per request, 0 for rows past ``num_seqs``."""
    R = query_start_loc.shape[0] - 1
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    return jnp.where(jnp.arange(R) < num_seqs, q_lens, 0)


def work_items(q_lens: jax.Array, block_q: int, *, decodes: bool = False
                ) -> tuple[jax.Array, jax.Array]:
    """Items of the chunk loop: ``block_q`` tokens of a request with more than one token (of
    every live request with ``decodes``).

    Returns:
      ``(cum, total)``: ``cum`` i32[R] inclusive prefix sums of the items per request,
      ``total`` i32[] the number of items. Decodes (one token) go to
      ``decode_pass.decode_pass`` unless ``decodes``.
    """
    n_blocks = jnp.where(q_lens > (0 if decodes else 1), (q_lens + block_q - 1) // block_q, 0)
    cum = jnp.cumsum(n_blocks)
    return cum, cum[-1]


def item_rows(
    i: jax.Array,  # i32[] the item
    cum: jax.Array,  # i32[R] inclusive prefix sums of the items per request
    query_start_loc: jax.Array,  # i32[R+1]
    seq_lens: jax.Array,  # i32[R]
    block_q: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Where item ``i`` sits: ``(r, start, in_item, q_pos)``, its request, its first token
    row, bool[Bq] which of its ``block_q`` rows belong to it, and i32[Bq] their positions
    (-1 outside it)."""
    r = jnp.searchsorted(cum, i, side="right").astype(jnp.int32)
    r = jnp.minimum(r, cum.shape[0] - 1)  # an item past the last (static_trips) reads row R-1
    first_block = jnp.where(r > 0, cum[jnp.maximum(r - 1, 0)], 0)
    start = query_start_loc[r] + (i - first_block) * block_q
    end = query_start_loc[r + 1]
    tok = start + jnp.arange(block_q, dtype=jnp.int32)  # [Bq]
    in_item = (tok < end) & (i < cum[-1])
    q_pos = jnp.where(in_item, seq_lens[r] - (end - tok), -1)
    return r, start, in_item, q_pos


def _attend_chunk(
    carry: tuple[jax.Array, jax.Array, jax.Array],
    q: jax.Array,  # f32[K, G*Bq, H], already scaled; row g*Bq + t is head g of token t
    kv: jax.Array,  # [S, 2*K, H] with S = C*L
    kv_pos: jax.Array,  # i32[S]
    q_pos: jax.Array,  # i32[G*Bq]; -1 for rows outside the item
    q_lo: jax.Array,  # i32[G*Bq] each row's first visible key
    kv_lo: jax.Array,  # i32[] the item's first visible key: slots before it may be garbage
    seq_len: jax.Array,  # i32[]
    scales: tuple[jax.Array, jax.Array],  # f32[] k_scale, v_scale
    soft_cap: float | None,
    mask_keys: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One online-softmax step over a chunk of cached tokens.

    The G query heads of a KV head are stacked as rows, so each KV head is one
    [G*Bq, H] x [H, S] product (XLA on CPU runs a few large dots much faster than many small
    ones). Only V is masked before its product: a NaN key only reaches scores that the
    ``where`` on ``s`` replaces. Under reverse mode a NaN key would also reach dq through
    ``ds @ k`` (0 * NaN), so ``mask_keys`` masks the keys too.
    """
    m, l, acc = carry  # f32[K, G*Bq], f32[K, G*Bq], f32[K, G*Bq, H]
    in_ctx = (kv_pos < seq_len) & (kv_pos >= kv_lo)  # [S]
    k_c = dequantize(kv[:, 0::2], scales[0])
    if mask_keys:
        k_c = jnp.where(in_ctx[:, None, None], k_c, 0.0)
    k_c = k_c.transpose(1, 2, 0)  # [K, H, S]
    v_c = jnp.where(in_ctx[:, None, None], dequantize(kv[:, 1::2], scales[1]), 0.0)
    v_c = v_c.transpose(1, 0, 2)  # [K, S, H]
    s = cap_scores(jnp.matmul(q, k_c, precision=HIGHEST), soft_cap)  # f32[K, G*Bq, S]
    visible = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] >= q_lo[:, None])
    visible &= in_ctx[None, :]  # [G*Bq, S]
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=-1))
    # Rows that have seen nothing yet keep m = -inf; shift by 0 there so exp() stays finite.
    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
    p = jnp.exp(s - m_safe[..., None])  # masked entries: exp(-inf) = 0
    alpha = jnp.exp(jnp.where(jnp.isneginf(m), -jnp.inf, m - m_safe))
    l = alpha * l + p.sum(axis=-1)
    acc = alpha[..., None] * acc + jnp.matmul(p, v_c, precision=HIGHEST)
    return m_new, l, acc


def attend_item(
    q_item: jax.Array,  # [Bq, N, H]
    q_pos: jax.Array,  # i32[Bq]; -1 outside the item
    kv_cache: jax.Array,  # [P, L, 2*K, H]
    pages: jax.Array,  # i32[max_blocks]
    seq_len: jax.Array,  # i32[]
    sliding_window: jax.Array,  # i32[]
    scales: tuple[jax.Array, jax.Array],  # f32[] k_scale, v_scale
    *,
    sm_scale: float,
    soft_cap: float | None,
    pages_per_chunk: int,
    values: jnp.dtype,
    static_trips: bool = False,
) -> jax.Array:
    """Attention of one item's query rows over its request's pages; returns f32[Bq, N, H].

    The chunk loop starts at the chunk holding the first key its first (earliest) row sees.
    With ``static_trips`` it walks every chunk of the table instead, masked, so that reverse
    mode can run it (a scan), and each step is recomputed in the backward rather than its
    [Bq, chunk] scores stored.
    """
    P, L, K2, H = kv_cache.shape
    K = K2 // 2
    Bq, N, _ = q_item.shape
    G = N // K
    C = pages_per_chunk
    max_blocks = pages.shape[0]
    # Pad the table so every chunk's slice is in bounds; padded entries are masked by seq_len.
    n_chunks_max = -(-max_blocks // C)
    pages = jnp.pad(pages, (0, n_chunks_max * C - max_blocks))
    q = q_item.astype(jnp.float32) * sm_scale
    q = q.reshape(Bq, K, G, H).transpose(1, 2, 0, 3).reshape(K, G * Bq, H)
    q_rows = jnp.tile(q_pos, G)  # [G*Bq], the position of each row of q
    q_lo = first_visible(q_rows, sliding_window)
    kv_lo = first_visible(q_pos[0], sliding_window)  # row 0 is in the item, the earliest
    last_pos = q_pos.max()
    n_chunks = jnp.clip(last_pos // (C * L) + 1, 0, n_chunks_max)

    def body(c: jax.Array, carry: tuple) -> tuple:
        idx = lax.dynamic_slice(pages, (c * C,), (C,))
        kv = jnp.take(kv_cache, jnp.clip(idx, 0, P - 1), axis=0).reshape(C * L, K2, H)
        kv = from_bits(kv, values)
        kv_pos = c * C * L + jnp.arange(C * L, dtype=jnp.int32)
        return _attend_chunk(carry, q, kv, kv_pos, q_rows, q_lo, kv_lo, seq_len, scales,
                             soft_cap, mask_keys=static_trips)

    init = (
        jnp.full((K, G * Bq), -jnp.inf, jnp.float32),
        jnp.zeros((K, G * Bq), jnp.float32),
        jnp.zeros((K, G * Bq, H), jnp.float32),
    )
    if static_trips:
        _, l, acc = lax.fori_loop(0, n_chunks_max, jax.checkpoint(body), init)
    else:
        _, l, acc = lax.fori_loop(kv_lo // (C * L), n_chunks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # rows with no visible key -> 0
    return out.reshape(K, G, Bq, H).transpose(2, 0, 1, 3).reshape(Bq, N, H)


@functools.partial(
    jax.jit,
    # Shapes of the loops depend on these; sm_scale is a per-model constant.
    static_argnames=(
        "sm_scale", "soft_cap", "block_q", "pages_per_chunk", "decode_pages_per_step",
        "kv_cache_dtype",
    ),
)
def ragged_paged_attention_reference(
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
    decode_pages_per_step: int | None = None,
    kv_cache_dtype: jnp.dtype | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Ragged paged attention in jnp (see the module docstring for the layout).

    Args:
      q: queries ``[T, N, H]`` (float32 or bfloat16).
      k, v: new keys/values ``[T, K, H]``, written into the cache (quantized) before attending.
      kv_cache: ``[P, L, 2*K, H]`` in any of ``cache_dtype.CACHE_DTYPES``, or uint8 holding
        the bits of fp8 values of ``kv_cache_dtype``.
      slot_mapping: i32[T] flat slot per token.
      block_tables: i32[R, max_blocks] pages of each request.
      seq_lens: i32[R] context length after this step.
      query_start_loc: i32[R+1] prefix sums of scheduled tokens.
      num_seqs: i32[] live requests.
      sm_scale: softmax scale (usually ``H ** -0.5``).
      sliding_window: i32[] the layer's window, 0 for full attention (traced: layers may differ).
      soft_cap: the scores' soft cap, or None.
      k_scale, v_scale: f32[] per-tensor scales of the cache's keys and values (traced: layers
        may differ).
      block_q: query rows per work item.
      pages_per_chunk: pages per online-softmax step of an item (default: 256 tokens' worth).
      decode_pages_per_step: pages per step of the decode pass (default: ~384 KiB gathered on
        CPU, ~64 MiB elsewhere).
      kv_cache_dtype: the dtype of the values of a uint8 cache (an fp8 dtype); None: the
        cache's own (checked by ``jaxengine_kernels.ragged_paged_attention``).

    Returns:
      ``(out [T, N, H] in q.dtype, kv_cache [P, L, 2*K, H])``.
    """
    T, N, H = q.shape
    L = kv_cache.shape[1]
    C = pages_per_chunk or max(1, DEFAULT_KV_TOKENS_PER_CHUNK // L)
    window = jnp.asarray(sliding_window, jnp.int32)
    scales = (jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32))
    values = kv_cache_dtype or kv_cache.dtype
    kv_cache = write_kv(kv_cache, k, v, slot_mapping, *scales, kv_cache_dtype=values)
    q_lens = live_q_lens(query_start_loc, num_seqs)
    is_decode = q_lens == 1
    # Every live request schedules at least one token, so live rows are among the first
    # min(R, T): the decode pass need not touch the padding rows of a large max_num_seqs.
    Rd = min(block_tables.shape[0], T)
    is_decode, q_start = is_decode[:Rd], query_start_loc[:Rd]
    out_dec = decode_pass(
        q, kv_cache, block_tables[:Rd], seq_lens[:Rd], q_start, is_decode, window, scales,
        sm_scale=sm_scale, soft_cap=soft_cap,
        pages_per_step=decode_pages_per_step or pages_per_step(kv_cache), values=values,
    )  # fmt: skip
    # Decode rows first (non-decodes scatter out of bounds and are dropped); the item loop
    # then fills the rows of longer requests. The token axis is padded so that every item's
    # [start, start + block_q) slice is in bounds.
    out = jnp.zeros((T + block_q, N, H), jnp.float32)
    dec_rows = jnp.where(is_decode, q_start, T + block_q)
    out = out.at[dec_rows].set(out_dec, mode="drop")
    cum, total = work_items(q_lens, block_q)
    q_pad = jnp.pad(q, ((0, block_q), (0, 0), (0, 0)))

    def item(i: jax.Array, out: jax.Array) -> jax.Array:
        r, start, in_item, q_pos = item_rows(i, cum, query_start_loc, seq_lens, block_q)
        q_item = lax.dynamic_slice_in_dim(q_pad, start, block_q)
        o = attend_item(
            q_item,
            q_pos,
            kv_cache,
            block_tables[r],
            seq_lens[r],
            window,
            scales,
            sm_scale=sm_scale,
            soft_cap=soft_cap,
            pages_per_chunk=C,
            values=values,
        )
        old = lax.dynamic_slice_in_dim(out, start, block_q)
        new = jnp.where(in_item[:, None, None], o, old)
        return lax.dynamic_update_slice_in_dim(out, new, start, axis=0)

    out = lax.fori_loop(0, total, item, out)
    return out[:T].astype(q.dtype), kv_cache
