"""Ragged paged attention as a Pallas kernel for NVIDIA GPUs (Triton lowering).

Layout assumptions (see ``jaxengine_kernels.reference`` for the semantics):

- The new K/V are written with an XLA scatter before the kernel (``write_kv``); under the
  engine's jit with the cache donated, XLA updates the cache in place.
- Queries are regrouped into ``[K, Tq*Gp, H]``: the ``G = N // K`` heads of a kv head padded to
  a power of two ``Gp`` (Triton tiles are powers of two), so one kv head's rows for a run of
  tokens form one 2-D tile; row ``t*Gp + g`` is token t, head ``k*G + g``.
- Two launches, both gridded over (work item, kv head, kv split):
  * decode items: one per request with at most ``decode_tokens`` new tokens (decodes and
    short speculative chunks), split over ``num_splits`` ranges of its pages (split-K), then
    reduced with their running max / denominator in a second (jnp) pass;
  * prefill items: ``block_q`` tokens of one longer request each, one split, normalized in the
    kernel.
  Item lists are computed on device from the metadata and padded to static upper bounds;
  empty items exit after zero loop iterations.
- Each program gathers ``pages_per_iter`` pages of its kv head per step through the block
  table (``kv_ref[pages, :, 2*kh, :]``) and runs an online softmax in float32; masks use
  ``jnp.where`` so NaN in unused pages cannot leak. float32 dots use IEEE precision (not TF32).

Runs on CPU with ``interpret=True``; lowering to Triton IR is checked on CPU for an abstract
H200 (``tests/jaxengine_kernels``); it has not been timed on a GPU yet.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxengine_kernels.errors import UnsupportedShapeError
from jaxengine_kernels.gpu import body
from jaxengine_kernels.gpu.items import decode_items, gather_rows, prefill_items
from jaxengine_kernels.reference import write_kv


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_block_sizes(
    num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, num_reqs: int
) -> dict[str, int]:
    """Defaults: 16 decode rows, 64 prefill rows, 64 cached tokens per step, ~1k programs."""
    Gp = _pow2(num_heads // num_kv_heads)
    return {
        "decode_tokens": max(1, 16 // Gp),
        "block_q": max(1, 64 // Gp),
        "pages_per_iter": max(1, 64 // page_size),
        "num_splits": max(1, min(16, 1024 // (num_reqs * num_kv_heads))),
    }


def check_supported(
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    decode_tokens: int | None = None,
    block_q: int | None = None,
    pages_per_iter: int | None = None,
) -> None:
    """Raise ``UnsupportedShapeError`` if the Triton kernel cannot run these shapes.

    Block sizes left ``None`` take ``default_block_sizes``; ``num_heads`` is a multiple of
    ``num_kv_heads``. (``num_splits`` is free.)
    """
    defaults = default_block_sizes(num_heads, num_kv_heads, head_dim, page_size, num_reqs=1)
    decode_tokens = decode_tokens or defaults["decode_tokens"]
    block_q = block_q or defaults["block_q"]
    pages_per_iter = pages_per_iter or defaults["pages_per_iter"]
    Gp = _pow2(num_heads // num_kv_heads)
    dot_dims = {  # dimensions of Triton dots
        "head_dim": head_dim,
        "decode_tokens * padded heads per kv head": decode_tokens * Gp,
        "block_q * padded heads per kv head": block_q * Gp,
    }
    tiles = dot_dims | {"page_size": page_size, "pages_per_iter": pages_per_iter}
    for name, n in tiles.items():
        if n != _pow2(n):
            raise UnsupportedShapeError(name, n, "a power of two for the Triton kernel")
    for name, n in (dot_dims | {"pages_per_iter * page_size": pages_per_iter * page_size}).items():
        if n < 16:
            raise UnsupportedShapeError(name, n, ">= 16 for Triton dots")


def check_cache_dtype(cache_dtype: jnp.dtype, compute_capability: str) -> None:
    """Raise ``UnsupportedShapeError`` (field ``kv_cache_dtype``) for a float8_e4m3fn cache on
    a GPU under compute capability 8.9 (Ada, Hopper): Triton converts that format there only.
    """
    dtype = jnp.dtype(cache_dtype)
    major, minor = (int(x) for x in compute_capability.split(".")[:2])
    if dtype == jnp.float8_e4m3fn and (major, minor) < (8, 9):
        raise UnsupportedShapeError("kv_cache_dtype", dtype.name,
                                    f"float32, bfloat16 or float8_e5m2 on compute capability "
                                    f"{compute_capability} (float8_e4m3fn needs 8.9 or later)")


def check_shapes(q: jax.Array, kv_cache: jax.Array, sizes: dict[str, int]) -> None:
    """``check_supported`` for these arrays; ``ValueError`` for an inconsistent head layout."""
    _, N, H = q.shape
    _, L, K2, Hk = kv_cache.shape
    if K2 % 2 or N % (K2 // 2) or Hk != H:
        raise ValueError(f"bad head layout: q heads {N}, cache head slots {K2}, dims {H}/{Hk}")
    check_supported(num_heads=N, num_kv_heads=K2 // 2, head_dim=H, page_size=L,
                    decode_tokens=sizes["decode_tokens"], block_q=sizes["block_q"],
                    pages_per_iter=sizes["pages_per_iter"])  # fmt: skip


def _launch(
    items: tuple[jax.Array, ...],  # item_seq, item_q0: i32[I]; window i32[1]; scales f32[2]
    meta: tuple[jax.Array, ...],  # seq_lens, query_start_loc, block_tables
    q_k: jax.Array,  # [K, Tq*Gp, H]
    kv_cache: jax.Array,  # [P, L, 2*K, H]
    *,
    tokens: int,
    group: int,
    num_splits: int,
    sm_scale: float,
    soft_cap: float | None,
    pages_per_iter: int,
    interpret: bool,
    name: str,
) -> list[jax.Array]:
    """One pallas_call over (items, kv heads, splits); returns [o] or [o, m, l]."""
    K, _, H = q_k.shape
    I = items[0].shape[0]
    rows = tokens * _pow2(group)
    split = num_splits > 1
    o_dtype = jnp.float32 if split else q_k.dtype
    out_shape = [jax.ShapeDtypeStruct((num_splits, I, K, rows, H), o_dtype)]
    out_specs = [pl.BlockSpec((None, None, None, rows, H), lambda i, k, s: (s, i, k, 0, 0))]
    if split:
        for _ in range(2):  # m, l
            out_shape.append(jax.ShapeDtypeStruct((num_splits, I, K, rows), jnp.float32))
            out_specs.append(pl.BlockSpec((None, None, None, rows), lambda i, k, s: (s, i, k, 0)))
    return pl.pallas_call(
        functools.partial(
            body.kernel,
            sm_scale=sm_scale,
            soft_cap=soft_cap,
            tokens=tokens,
            group=group,
            pages_per_iter=pages_per_iter,
            num_splits=num_splits,
        ),  # fmt: skip
        grid=(I, K, num_splits),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=f"ragged_paged_attention_gpu_{name}",
    )(*items, *meta, q_k, kv_cache)


def _combine_splits(o: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Reduce split partials [S, I, K, rows, H] (+ m, l [S, I, K, rows]) to [I, K, rows, H]."""
    m_max = m.max(axis=0)
    w = jnp.exp(m - m_max[None])  # empty splits: m = MASK_VALUE -> weight 0
    l_sum = (w * l).sum(axis=0)
    o_sum = (w[..., None] * o).sum(axis=0)
    return o_sum / jnp.where(l_sum == 0.0, 1.0, l_sum)[..., None]


@functools.partial(
    jax.jit,
    # Block sizes fix the grid and the tile shapes; interpret selects the lowering.
    static_argnames=(
        "sm_scale", "soft_cap", "interpret", "decode_tokens", "block_q", "pages_per_iter",
        "num_splits",
    ),
)  # fmt: skip
def ragged_paged_attention_gpu(
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
    interpret: bool = False,
    decode_tokens: int | None = None,
    block_q: int | None = None,
    pages_per_iter: int | None = None,
    num_splits: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Ragged paged attention on NVIDIA GPUs (same contract as ``ragged_paged_attention``).

    Args:
      q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, num_seqs: as in
        ``jaxengine_kernels.ragged_paged_attention``.
      sm_scale: softmax scale.
      sliding_window: i32[] the layer's window (0: full attention): each item reads from the
        page of its first token's first visible key.
      soft_cap: the scores' soft cap, or None.
      k_scale, v_scale: f32[] per-tensor scales of the cached keys and values: pages are
        loaded in the cache's dtype and widened in the kernel.
      interpret: run the kernel in the Pallas interpreter (CPU).
      decode_tokens: requests with at most this many new tokens take the split-K decode path.
      block_q: tokens per prefill work item.
      pages_per_iter: pages gathered per online-softmax step.
      num_splits: kv splits per decode item (1 disables split-K).

    Returns:
      ``(out [T, N, H] in q.dtype, kv_cache)``.

    Raises:
      UnsupportedShapeError: for shapes the kernel does not handle (see
        ``check_supported``); ValueError for inconsistent head layouts.
    """
    T, N, H = q.shape
    _, L, K2, _ = kv_cache.shape
    K, R = K2 // 2, block_tables.shape[0]
    given = {"decode_tokens": decode_tokens, "block_q": block_q,
             "pages_per_iter": pages_per_iter, "num_splits": num_splits}  # fmt: skip
    sizes = default_block_sizes(N, K, H, L, R) | {n: s for n, s in given.items() if s}
    check_shapes(q, kv_cache, sizes)
    G = N // K
    Gp = _pow2(G)
    dq, bq = sizes["decode_tokens"], sizes["block_q"]
    kv_cache = write_kv(kv_cache, k, v, slot_mapping, k_scale, v_scale)
    # [T, N, H] -> [K, Tq*Gp, H], with room for an item that starts at the last token.
    Tq = T + max(dq, bq)
    q_k = jnp.pad(q.reshape(T, K, G, H), ((0, Tq - T), (0, 0), (0, Gp - G), (0, 0)))
    q_k = q_k.transpose(1, 0, 2, 3).reshape(K, Tq * Gp, H)
    meta = (seq_lens, query_start_loc, block_tables)
    common = dict(sm_scale=sm_scale, soft_cap=soft_cap, pages_per_iter=sizes["pages_per_iter"],
                  group=G, interpret=interpret)  # fmt: skip
    layer = (jnp.reshape(sliding_window, (1,)).astype(jnp.int32),  # the layer's operands
             jnp.stack([jnp.asarray(k_scale), jnp.asarray(v_scale)]).astype(jnp.float32))
    n_dec = sizes["num_splits"]
    dec = _launch(decode_items(query_start_loc, num_seqs, dq) + layer, meta, q_k, kv_cache,
                  tokens=dq, num_splits=n_dec, name="decode", **common)  # fmt: skip
    out_dec = _combine_splits(*dec) if n_dec > 1 else dec[0][0]
    pre_items, pre_first = prefill_items(query_start_loc, num_seqs, dq, bq, T)
    (out_pre,) = _launch(
        pre_items + layer, meta, q_k, kv_cache, tokens=bq, num_splits=1, name="prefill",
        **common,
    )
    out = gather_rows(
        out_dec, out_pre[0], pre_first, query_start_loc, num_seqs,
        num_tokens=T, decode_tokens=dq, block_q=bq, group=G,
    )  # fmt: skip
    return out.astype(q.dtype), kv_cache
