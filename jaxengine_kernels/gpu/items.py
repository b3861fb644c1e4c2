"""Work items of the GPU kernel, and the gather of their rows back to token order.

All on device with jnp, from the traced metadata, padded to static upper bounds:
- a decode item per request with ``1 <= q_len <= decode_tokens`` (item i = request i);
- prefill items of ``block_q`` tokens for every longer request, in request order.
Items that do not exist have request -1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxengine_kernels.reference import live_q_lens


def decode_items(
    query_start_loc: jax.Array,  # i32[R+1]
    num_seqs: jax.Array,  # i32[]
    decode_tokens: int,
) -> tuple[jax.Array, jax.Array]:
    """``(item_seq i32[R], item_q0 i32[R])``: request r's decode item, or -1 if it has none."""
    R = query_start_loc.shape[0] - 1
    q_lens = live_q_lens(query_start_loc, num_seqs)
    is_dec = (q_lens >= 1) & (q_lens <= decode_tokens)
    return jnp.where(is_dec, jnp.arange(R, dtype=jnp.int32), -1), query_start_loc[:-1]


def num_prefill_items(num_tokens: int, num_reqs: int, decode_tokens: int, block_q: int) -> int:
    """Static bound: every prefill request wastes at most one partial block."""
    return -(-num_tokens // block_q) + min(num_reqs, num_tokens // (decode_tokens + 1))


def prefill_items(
    query_start_loc: jax.Array,  # i32[R+1]
    num_seqs: jax.Array,  # i32[]
    decode_tokens: int,
    block_q: int,
    num_tokens: int,
) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """``((item_seq i32[I], item_q0 i32[I]), first_item i32[R])`` for the prefill launch."""
    R = query_start_loc.shape[0] - 1
    I = num_prefill_items(num_tokens, R, decode_tokens, block_q)
    q_lens = live_q_lens(query_start_loc, num_seqs)
    n_blocks = jnp.where(q_lens > decode_tokens, (q_lens + block_q - 1) // block_q, 0)
    cum = jnp.cumsum(n_blocks)
    first = (cum - n_blocks).astype(jnp.int32)
    i = jnp.arange(I, dtype=jnp.int32)
    r = jnp.minimum(jnp.searchsorted(cum, i, side="right"), R - 1).astype(jnp.int32)
    item_seq = jnp.where(i < cum[-1], r, -1)
    item_q0 = query_start_loc[r] + (i - first[r]) * block_q
    return (item_seq, item_q0.astype(jnp.int32)), first


def gather_rows(
    out_dec: jax.Array,  # [R, K, Dq*Gp, H]
    out_pre: jax.Array,  # [I, K, Bq*Gp, H]
    pre_first: jax.Array,  # i32[R] first prefill item of each request
    query_start_loc: jax.Array,  # i32[R+1]
    num_seqs: jax.Array,  # i32[]
    *,
    num_tokens: int,
    decode_tokens: int,
    block_q: int,
    group: int,
) -> jax.Array:  # [T, N, H]; padding rows hold zeros or some item's rows (finite)
    """Put each token's rows back in token order, from whichever launch computed them."""
    R, K, _, H = out_dec.shape
    I = out_pre.shape[0]
    Gp = out_dec.shape[2] // decode_tokens
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    r = jnp.minimum(jnp.searchsorted(query_start_loc[1:], t, side="right"), R - 1)
    j = jnp.maximum(t - query_start_loc[r], 0)  # token index inside its request
    is_dec = live_q_lens(query_start_loc, num_seqs)[r] <= decode_tokens
    dec = out_dec.reshape(R, K, decode_tokens, Gp, H)[r, :, jnp.minimum(j, decode_tokens - 1)]
    item = jnp.minimum(pre_first[r] + j // block_q, I - 1)
    pre = out_pre.reshape(I, K, block_q, Gp, H)[item, :, j % block_q]  # [T, K, Gp, H]
    out = jnp.where(is_dec[:, None, None, None], dec.astype(pre.dtype), pre)
    return out[:, :, :group].reshape(num_tokens, K * group, H)
