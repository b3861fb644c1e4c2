"""The body of the GPU (Pallas Triton) ragged paged attention kernel.

One program = one work item (up to ``tokens`` query tokens of one request, times the padded
heads of one kv head: ``rows = tokens * Gp``) x one kv head x one kv split. It walks its split's
pages ``pages_per_iter`` at a time with an online softmax (float32) and writes either the
normalized output (one split) or the unnormalized accumulator with its running max and
denominator (several splits; ``jaxengine_kernels.gpu.kernel`` reduces them in a second pass).
With a sliding window, the splits share the pages from the one holding the first key the
item's first token sees: the pages before are not read.
A quantized cache's pages are loaded in its dtype and widened for the dots (``dot_dtype``);
``k_scale`` multiplies the scores with ``sm_scale``, ``v_scale`` the accumulator as it is
stored (per-tensor scalars: exact to float32 rounding).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxengine_kernels.cache_dtype import dot_dtype
from jaxengine_kernels.scores import cap_scores, first_visible

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

Ref = Any  # a Pallas ref


def kernel(
    item_seq_ref: Ref,  # i32[I]: request of each item, -1 for an empty item
    item_q0_ref: Ref,  # i32[I]: first token of each item
    window_ref: Ref,  # i32[1]: the sliding window, 0 for full attention
    scales_ref: Ref,  # f32[2]: k_scale, v_scale
    seq_lens_ref: Ref,  # i32[R]
    cu_q_ref: Ref,  # i32[R+1]
    block_tables_ref: Ref,  # i32[R, max_blocks]
    q_ref: Ref,  # [K, Tq*Gp, H]
    kv_ref: Ref,  # [P, L, 2*K, H]
    o_ref: Ref,  # [rows, H]: this (split, item, kv head)'s block
    *stats_refs: Ref,  # () or (m f32[rows], l f32[rows]) when splitting
    sm_scale: float,
    soft_cap: float | None,
    tokens: int,
    group: int,
    pages_per_iter: int,
    num_splits: int,
) -> None:
    """Attention of one item's rows for one kv head over one split of its request's pages."""
    item, kh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, H = o_ref.shape
    Gp = rows // tokens
    L = kv_ref.shape[1]
    seq_raw = item_seq_ref[item]
    live = seq_raw >= 0
    seq = jnp.maximum(seq_raw, 0)
    q0 = item_q0_ref[item]
    q_end, kv_len = cu_q_ref[seq + 1], seq_lens_ref[seq]
    window = window_ref[0]
    # Pages this item needs: from its first token's first visible key to its last token.
    last_pos = kv_len - (q_end - (jnp.minimum(q0 + tokens, q_end) - 1))
    ctx_start = first_visible(kv_len - (q_end - q0), window)
    page_lo = ctx_start // L
    n_pages = jnp.where(live, last_pos // L + 1 - page_lo, 0)
    per_split = pl.cdiv(n_pages, num_splits)
    p0 = page_lo + split * per_split
    p1 = jnp.minimum(p0 + per_split, page_lo + n_pages)
    r = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    tok = q0 + r // Gp
    row_ok = (tok < q_end) & (r % Gp < group)  # padded heads and other requests' tokens out
    row_pos = jnp.where(row_ok, kv_len - (q_end - tok), -1)
    q = q_ref[kh, pl.ds(q0 * Gp, rows), :]  # [rows, H]
    n_iter = pl.cdiv(jnp.maximum(p1 - p0, 0), pages_per_iter)
    ctx_end = jnp.minimum(p1 * L, kv_len)

    score_scale = sm_scale * scales_ref[0]

    def body(it: jax.Array, carry: tuple) -> tuple:
        first_page = p0 + it * pages_per_iter
        return _online_step(
            carry, q, kv_ref, block_tables_ref, seq, kh, first_page, ctx_start, ctx_end, row_pos,
            window, score_scale, soft_cap=soft_cap, pages_per_iter=pages_per_iter,
        )  # fmt: skip

    init = (
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, H), jnp.float32),
    )
    m, l, acc = lax.fori_loop(0, n_iter, body, init)
    acc = acc * scales_ref[1]
    if stats_refs:
        m_ref, l_ref = stats_refs
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l
    else:
        o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)


def _online_step(
    carry: tuple[jax.Array, jax.Array, jax.Array],  # m f32[rows], l f32[rows], acc f32[rows, H]
    q: jax.Array,  # [rows, H]
    kv_ref: Ref,  # [P, L, 2*K, H]
    block_tables_ref: Ref,  # i32[R, max_blocks]
    seq: jax.Array,
    kh: jax.Array,
    first_page: jax.Array,  # index into the request's block table
    ctx_start: jax.Array,  # the first position this item may read (slots before: garbage)
    ctx_end: jax.Array,  # one past the last position this split may read
    row_pos: jax.Array,  # i32[rows], -1 for dead rows
    window: jax.Array,  # i32[]
    score_scale: jax.Array,  # f32[] sm_scale * k_scale
    *,
    soft_cap: float | None,
    pages_per_iter: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gather ``pages_per_iter`` pages of kv head ``kh`` and fold them into the softmax state."""
    m, l, acc = carry
    _, L, _, H = kv_ref.shape
    max_blocks = block_tables_ref.shape[1]
    cols = pages_per_iter * L
    idx = jnp.minimum(first_page + jnp.arange(pages_per_iter), max_blocks - 1)
    pages = block_tables_ref[seq, idx]  # i32[C]
    k = kv_ref[pages, :, 2 * kh, :].reshape(cols, H)
    v = kv_ref[pages, :, 2 * kh + 1, :].reshape(cols, H)
    col = first_page * L + jnp.arange(cols)
    in_ctx = (col < ctx_end) & (col >= ctx_start)  # [cols]
    v = jnp.where(in_ctx[:, None], v, jnp.zeros_like(v))  # NaN in stale slots stays out of p @ v
    dtype = dot_dtype(q.dtype, k.dtype)
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None  # IEEE, not TF32
    s = lax.dot_general(
        q.astype(dtype), k.astype(dtype), (((1,), (1,)), ((), ())),
        precision=precision, preferred_element_type=jnp.float32,
    )  # fmt: skip
    row_first = first_visible(row_pos, window)
    visible = in_ctx[None, :] & (col[None, :] <= row_pos[:, None])  # [rows, cols]
    visible &= col[None, :] >= row_first[:, None]
    s = jnp.where(visible, cap_scores(s * score_scale, soft_cap), MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    l = alpha * l + p.sum(axis=1)
    pv = jnp.dot(p.astype(dtype), v.astype(dtype), precision=precision,
                 preferred_element_type=jnp.float32)
    return m_new, l, alpha[:, None] * acc + pv
