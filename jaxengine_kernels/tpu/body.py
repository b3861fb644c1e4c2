"""The body of the TPU ragged paged attention kernel (layouts: ``jaxengine_kernels.tpu.kernel``).

One grid step = one q-block of ``block_q`` tokens. It (1) DMAs its tokens' new K/V rows into the
cache, (2) walks every (request, kv block) pair that the block's tokens need, double-buffering
the page copies, with an online softmax per kv head, and (3) writes the normalized output.
With a sliding window, a request's walk starts at the kv block holding the first key its first
token in the q-block sees: the blocks before are not copied.
Pages are copied in the cache's dtype and widened for the dots (``dot_dtype``); ``k_scale``
multiplies the scores with ``sm_scale`` and ``v_scale`` the normalised output (per-tensor
scalars, scalar-prefetched).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxengine_kernels.cache_dtype import dot_dtype
from jaxengine_kernels.scores import cap_scores, first_visible

# A large finite negative: masked logits stay finite, so exp(m_prev - m_new) never sees inf-inf.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

Ref = Any  # a Pallas ref


class Refs(NamedTuple):
    """The kernel's refs and the block's bounds, passed to the helpers."""

    seq_lens: Ref  # SMEM i32[R]
    block_tables: Ref  # SMEM i32[R * max_blocks]
    cu_q: Ref  # SMEM i32[R+1]
    q: Ref  # VMEM [K, Bq*G, H]
    kv: Ref  # HBM [P, L, 2*K, H] (the aliased output)
    kv_bufs: Ref  # VMEM [2, C, L, 2*K, H]
    sems: Ref  # DMA semaphores [2]
    m: Ref  # VMEM f32[K, Bq*G, 128]
    l: Ref  # VMEM f32[K, Bq*G, 128]
    acc: Ref  # VMEM f32[K, Bq*G, H]
    num_seqs: jax.Array  # i32[]
    window: jax.Array  # i32[] the sliding window, 0 for full attention
    score_scale: jax.Array  # f32[] sm_scale * k_scale
    blk_start: jax.Array  # i32[] first token of the q-block
    blk_end: jax.Array  # i32[] one past its last live token
    soft_cap: float | None
    block_q: int  # tokens per q-block (rows = block_q * G)
    max_blocks: int  # row length of the flattened block table


def kernel(
    seq_lens_ref: Ref,  # SMEM i32[R]
    block_tables_ref: Ref,  # SMEM i32[R * max_blocks], row-major
    cu_q_ref: Ref,  # SMEM i32[R+1]
    num_seqs_ref: Ref,  # SMEM i32[1]
    window_ref: Ref,  # SMEM i32[1]
    scales_ref: Ref,  # SMEM f32[2]: k_scale, v_scale
    slots_ref: Ref,  # SMEM i32[Tp]
    first_seq_ref: Ref,  # SMEM i32[num_q_blocks]
    q_ref: Ref,  # VMEM [K, Bq*G, H]
    kv_new_ref: Ref,  # VMEM [Bq, 2*K, H]
    kv_in_ref: Ref,  # HBM [P, L, 2*K, H], aliased to kv_ref
    o_ref: Ref,  # VMEM [K, Bq*G, H]
    kv_ref: Ref,  # HBM [P, L, 2*K, H]
    kv_bufs: Ref,  # VMEM [2, C, L, 2*K, H]
    sems: Ref,  # DMA[2]
    write_sem: Ref,  # DMA[]
    m_ref: Ref,  # VMEM f32[K, Bq*G, 128]
    l_ref: Ref,  # VMEM f32[K, Bq*G, 128]
    acc_ref: Ref,  # VMEM f32[K, Bq*G, H]
    *,
    sm_scale: float,
    soft_cap: float | None,
    block_q: int,
    max_blocks: int,
) -> None:
    """One q-block: write its K/V, attend over its requests' pages, store the output."""
    del kv_in_ref  # read and written through the aliased output ref
    b = pl.program_id(0)
    num_seqs = num_seqs_ref[0]
    blk_start = b * block_q
    blk_end = jnp.minimum(blk_start + block_q, cu_q_ref[num_seqs])
    _write_new_kv(slots_ref, kv_new_ref, kv_ref, write_sem, blk_start, blk_end)
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    refs = Refs(
        seq_lens=seq_lens_ref, block_tables=block_tables_ref, cu_q=cu_q_ref, q=q_ref,
        kv=kv_ref, kv_bufs=kv_bufs, sems=sems, m=m_ref, l=l_ref, acc=acc_ref,
        num_seqs=num_seqs, window=window_ref[0], score_scale=sm_scale * scales_ref[0],
        blk_start=blk_start, blk_end=blk_end, soft_cap=soft_cap, block_q=block_q,
        max_blocks=max_blocks,
    )  # fmt: skip
    _walk_requests(refs, first_seq_ref[b])
    for kh in range(o_ref.shape[0]):
        l = l_ref[kh][:, :1]
        o_ref[kh] = (acc_ref[kh] * (scales_ref[1] / jnp.where(l == 0.0, 1.0, l))).astype(
            o_ref.dtype)


def _write_new_kv(
    slots_ref: Ref,  # SMEM i32[Tp]
    kv_new_ref: Ref,  # VMEM [Bq, 2*K, H]
    kv_ref: Ref,  # HBM [P, L, 2*K, H]
    sem: Ref,
    blk_start: jax.Array,
    blk_end: jax.Array,
) -> None:
    """DMA each live token's interleaved K/V row to its slot, then wait for all of them."""
    L = kv_ref.shape[1]
    n = jnp.maximum(blk_end - blk_start, 0)

    def copy(i: jax.Array) -> pltpu.AsyncCopyDescriptor:
        slot = slots_ref[blk_start + i]
        dst = kv_ref.at[slot // L, pl.ds(slot % L, 1)]
        return pltpu.make_async_copy(kv_new_ref.at[pl.ds(i, 1)], dst, sem)

    lax.fori_loop(0, n, lambda i, c: (copy(i).start(), c)[1], 0)
    lax.fori_loop(0, n, lambda i, c: (copy(i).wait(), c)[1], 0)


def _kv_block_copies(refs: Refs, seq: jax.Array, kv_blk: jax.Array, buf: jax.Array) -> list:
    """The page copies of kv block ``kv_blk`` of request ``seq`` into buffer ``buf``."""
    _, C, L, _, _ = refs.kv_bufs.shape
    n_pages = pl.cdiv(refs.seq_lens[seq], L)
    copies = []
    for i in range(C):
        idx = kv_blk * C + i
        # Past the request's last page: copy its first page again (masked out by seq_len).
        idx = jnp.where(idx < n_pages, idx, 0)
        page = refs.block_tables[seq * refs.max_blocks + idx]
        copies.append(
            pltpu.make_async_copy(refs.kv.at[page], refs.kv_bufs.at[buf, i], refs.sems.at[buf])
        )
    return copies


def _first_key(refs: Refs, seq: jax.Array) -> jax.Array:
    """The first key position the first token of request ``seq`` in this q-block sees."""
    q_end = refs.cu_q[seq + 1]
    first_tok = jnp.maximum(refs.cu_q[seq], refs.blk_start)
    return first_visible(refs.seq_lens[seq] - (q_end - first_tok), refs.window)


def _walk_requests(refs: Refs, first_seq: jax.Array) -> None:
    """Loop over (request, kv block) pairs with tokens in this q-block, prefetching the next."""
    _, C, L, _, _ = refs.kv_bufs.shape
    block_kv = C * L
    last_seq = refs.seq_lens.shape[0] - 1

    def first_kv_block(seq: jax.Array) -> jax.Array:  # any value past the live requests
        return _first_key(refs, jnp.minimum(seq, last_seq)) // block_kv

    def live(seq: jax.Array) -> jax.Array:
        return (seq < refs.num_seqs) & (refs.cu_q[seq] < refs.blk_end)

    def num_kv_blocks(seq: jax.Array) -> jax.Array:
        # Only up to the position of the request's last token inside this q-block.
        q_end = refs.cu_q[seq + 1]
        last_tok = jnp.minimum(q_end, refs.blk_end) - 1
        last_pos = refs.seq_lens[seq] - (q_end - last_tok)
        return last_pos // block_kv + 1

    def step(state: tuple[jax.Array, jax.Array, jax.Array]) -> tuple:
        seq, kv_blk, buf = state
        done_seq = kv_blk + 1 >= num_kv_blocks(seq)
        nxt_seq = jnp.where(done_seq, seq + 1, seq)
        nxt_blk = jnp.where(done_seq, first_kv_block(nxt_seq), kv_blk + 1)

        @pl.when(live(nxt_seq))
        def _prefetch() -> None:
            for c in _kv_block_copies(refs, nxt_seq, nxt_blk, 1 - buf):
                c.start()

        for c in _kv_block_copies(refs, seq, kv_blk, buf):
            c.wait()
        _attend_kv_block(refs, seq, kv_blk, buf)
        return nxt_seq, nxt_blk, 1 - buf

    first_blk = first_kv_block(first_seq)

    @pl.when(live(first_seq))
    def _first_fetch() -> None:
        for c in _kv_block_copies(refs, first_seq, first_blk, 0):
            c.start()

    lax.while_loop(lambda s: live(s[0]), step, (first_seq, first_blk, jnp.int32(0)))


def _attend_kv_block(refs: Refs, seq: jax.Array, kv_blk: jax.Array, buf: jax.Array) -> None:
    """Online-softmax update of every kv head's rows of request ``seq`` with one kv block."""
    K, rows, _ = refs.q.shape
    _, C, L, _, H = refs.kv_bufs.shape
    cols = C * L
    q_start, q_end = refs.cu_q[seq], refs.cu_q[seq + 1]
    kv_len = refs.seq_lens[seq]
    group = rows // refs.block_q  # G query heads per token
    tok = refs.blk_start + lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group
    col = kv_blk * cols + lax.broadcasted_iota(jnp.int32, (1, cols), 1)
    row_in = (tok >= q_start) & (tok < q_end)  # [rows, 1]
    row_pos = kv_len - (q_end - tok)  # [rows, 1]
    # [rows, cols]; implies seen
    visible = row_in & (col <= row_pos) & (col >= first_visible(row_pos, refs.window))
    # Columns some row of this block may see: up to the position of the request's last token
    # in the block. Not `col < kv_len`: the slots of the request's tokens in later q-blocks are
    # not written yet and hold whatever the page held before (NaN, Inf).
    seen_end = kv_len - (q_end - jnp.minimum(q_end, refs.blk_end))
    # Nor the slots before the first key the request's first token here sees: their pages may
    # have slid out of the window and hold another request's data.
    seen_col = kv_blk * cols + lax.broadcasted_iota(jnp.int32, (cols, 1), 0)
    seen = (seen_col < seen_end) & (seen_col >= _first_key(refs, seq))
    for kh in range(K):
        k = refs.kv_bufs[buf, :, :, 2 * kh, :].reshape(cols, H)
        v = refs.kv_bufs[buf, :, :, 2 * kh + 1, :].reshape(cols, H)
        # A select, not p = 0: 0 * NaN and 0 * Inf are NaN in p @ v.
        v = jnp.where(seen, v, jnp.zeros_like(v))
        _online_softmax_update(refs, kh, k, v, visible, row_in)


def _online_softmax_update(
    refs: Refs,
    kh: int,
    k: jax.Array,  # [Bkv, H]
    v: jax.Array,  # [Bkv, H]
    visible: jax.Array,  # bool[rows, Bkv]
    row_in: jax.Array,  # bool[rows, 1]
) -> None:
    """Fold one kv block into kv head ``kh``'s running max, denominator and accumulator."""
    q = refs.q[kh]  # [rows, H]
    dtype = dot_dtype(q.dtype, k.dtype)
    s = lax.dot_general(q.astype(dtype), k.astype(dtype), (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32)
    s = jnp.where(visible, cap_scores(s * refs.score_scale, refs.soft_cap), MASK_VALUE)
    m_prev = refs.m[kh][:, :1]  # [rows, 1]
    l_prev = refs.l[kh][:, :1]
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    p = jnp.where(visible, jnp.exp(s - m_new), 0.0)  # [rows, Bkv]
    alpha = jnp.exp(m_prev - m_new)
    l_new = alpha * l_prev + p.sum(axis=1, keepdims=True)
    pv = jnp.dot(p.astype(dtype), v.astype(dtype), preferred_element_type=jnp.float32)
    acc_new = alpha * refs.acc[kh] + pv
    # Rows of other requests in the block keep their state.
    lanes = refs.m.shape[-1]
    refs.m[kh] = jnp.where(row_in, jnp.broadcast_to(m_new, (m_new.shape[0], lanes)), refs.m[kh])
    refs.l[kh] = jnp.where(row_in, jnp.broadcast_to(l_new, (l_new.shape[0], lanes)), refs.l[kh])
    refs.acc[kh] = jnp.where(row_in, acc_new, refs.acc[kh])
