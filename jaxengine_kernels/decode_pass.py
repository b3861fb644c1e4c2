"""The reference's decode pass: every one-token request of a step at once, as one loop over
the flat list of their live pages (the layout: ``jaxengine_kernels.reference``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxengine_kernels.cache_dtype import dequantize, from_bits
from jaxengine_kernels.scores import HIGHEST, cap_scores, first_visible


def decode_pass(
    q: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [P, L, 2*K, H]
    block_tables: jax.Array,  # i32[R, max_blocks]
    seq_lens: jax.Array,  # i32[R]
    q_start: jax.Array,  # i32[R] each request's first token
    is_decode: jax.Array,  # bool[R]
    sliding_window: jax.Array,  # i32[]
    scales: tuple[jax.Array, jax.Array],  # f32[] k_scale, v_scale
    *,
    sm_scale: float,
    soft_cap: float | None,
    pages_per_step: int,
    values: jnp.dtype,
) -> jax.Array:  # f32[R, N, H]; rows of non-decode requests are zeros
    """All one-token requests at once, as one loop over the flat list of their pages.

    The live pages of every decode are numbered consecutively (request by request); each step
    of the loop gathers the next ``pages_per_step`` of them, whatever requests they belong to,
    and folds them into their request's online softmax with segment max/sum scatters. The trip
    count is ``ceil(live pages / pages_per_step)``: work follows the total context, so one long
    request among short ones costs its own pages, not ``R * its pages``. With a window, a
    request's pages are numbered from the one holding its first visible key: the pages before
    it are not read.
    """
    T, N, H = q.shape
    P, L, K2, _ = kv_cache.shape
    R, max_blocks = block_tables.shape
    K, W = K2 // 2, pages_per_step
    G = N // K
    ctx = jnp.where(is_decode, seq_lens, 0)
    lo = first_visible(ctx - 1, sliding_window)  # i32[R] each decode's first visible key
    first_page = lo // L
    n_pages = (ctx + L - 1) // L - first_page  # i32[R] pages read (0 for non-decodes)
    ends = jnp.cumsum(n_pages)  # i32[R] one past each request's last flat page
    q_r = q[jnp.clip(q_start, 0, T - 1)].astype(jnp.float32) * sm_scale
    q_r = q_r.reshape(R, K, G, H)
    offsets = jnp.arange(L, dtype=jnp.int32)

    def body(i: jax.Array, carry: tuple) -> tuple:
        m, l, acc = carry  # f32[R, K, G], f32[R, K, G], f32[R, K, G, H]
        flat = i * W + jnp.arange(W, dtype=jnp.int32)  # [W] flat page numbers
        # Request of each page; R past the last live page, where the scatters below drop it.
        req = jnp.searchsorted(ends, flat, side="right").astype(jnp.int32)
        live = req < R
        r = jnp.minimum(req, R - 1)
        page_no = flat - (ends[r] - n_pages[r]) + first_page[r]  # [W] into the request's table
        page = block_tables[r, jnp.clip(page_no, 0, max_blocks - 1)]
        kv = from_bits(kv_cache[jnp.clip(page, 0, P - 1)], values).reshape(W, L, K, 2, H)
        key_pos = page_no[:, None] * L + offsets  # [W, L]
        valid = live[:, None] & (key_pos < ctx[r][:, None]) & (key_pos >= lo[r][:, None])
        keys = dequantize(kv[:, :, :, 0], scales[0])  # f32[W, L, K, H]
        s = jnp.einsum("wlkh,wkgh->wlkg", keys, q_r[r], precision=HIGHEST)
        s = cap_scores(s, soft_cap)
        s = jnp.where(valid[:, :, None, None], s, -jnp.inf)  # [W, L, K, G]
        m_new = m.at[req].max(s.max(axis=1), mode="drop")
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p = jnp.exp(s - m_safe[r][:, None])  # [W, L, K, G]; masked -> 0
        alpha = jnp.exp(jnp.where(jnp.isneginf(m), -jnp.inf, m - m_safe))
        v = dequantize(kv[:, :, :, 1], scales[1])
        v = jnp.where(valid[:, :, None, None], v, 0.0)  # NaN-safe: masked, not *0
        pv = jnp.einsum("wlkg,wlkh->wkgh", p, v, precision=HIGHEST)
        l = alpha * l + jnp.zeros_like(l).at[req].add(p.sum(axis=1), mode="drop")
        acc = alpha[..., None] * acc + jnp.zeros_like(acc).at[req].add(pv, mode="drop")
        return m_new, l, acc

    init = (
        jnp.full((R, K, G), -jnp.inf, jnp.float32),
        jnp.zeros((R, K, G), jnp.float32),
        jnp.zeros((R, K, G, H), jnp.float32),
    )
    _, l, acc = lax.fori_loop(0, (ends[-1] + W - 1) // W, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(R, N, H)


def pages_per_step(kv_cache: jax.Array) -> int:
    """Pages per decode-pass step: ~384 KiB gathered on CPU (a step stays in cache; loop
    iterations are cheap), ~64 MiB on accelerators (fewer, larger steps). On CPU, 16 SmolLM2
    pages a step beat 64 on long and mixed contexts, and a request-vectorized pass on every
    case (docs/BENCHMARKS.md §4, "Why the jnp reference is as it is").
    """
    _, L, K2, H = kv_cache.shape
    per_page = L * K2 * H * 4  # float32 after the upcast
    budget = (384 << 10) if jax.default_backend() == "cpu" else (64 << 20)
    return max(1, budget // per_page)
