"""Ragged paged attention on the CPU: a native kernel behind an XLA FFI custom call.

Layout assumptions and semantics are the jnp reference's (``jaxengine_kernels.reference``):

- The new K/V are written with the reference's XLA scatter (``write_kv``) first; under the
  engine's jit with the cache donated, XLA updates the cache in place, and the kernel then
  reads the pages where they are (no gather, no copy). For fp8 that holds when the cache is
  stored as its bits (uint8, ``kv_cache_dtype`` naming the format; the engine's on CPU): XLA
  on CPU converts a whole fp8 cache to scatter into it (docs/BENCHMARKS.md §4), and the kernel
  reads bytes either way.
- The kernel (``ragged_paged_attention.cc``, compiled by ``native.py``) cuts the live requests
  into units: requests of at most 8 tokens (decodes, speculative chunks) as a whole, split over
  runs of ``pages_per_split`` pages when longer; longer requests (prefill chunks) in runs of
  ``block_q`` tokens. XLA's intra-op threads share the units, longest first. A unit walks its
  keys in tiles of 64 positions on AVX-512 (an online-softmax step each), asking for each
  token's cache row 4 keys before it is read. A decode takes every KV head's dots of one token
  row before the next row's, a vector's width of keys at a time; a prefill chunk computes the
  tile's scores transposed (a vector of query rows per key) and its softmax down the keys.
- float32 arithmetic: queries are passed as float32 and cache rows widened as they are read
  (a float32, bfloat16, float8_e4m3fn or float8_e5m2 cache); ``k_scale`` is folded into the
  query scale and ``v_scale`` into the output's normalisation (per-tensor scalars, exact to
  float32 rounding). The output is cast back to q's dtype. Only slots inside a request's
  context are read, so garbage (NaN) elsewhere cannot leak.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine_kernels.cpu import native
from jaxengine_kernels.errors import UnsupportedShapeError
from jaxengine_kernels.reference import write_kv

# Defaults (docs/BENCHMARKS.md §4, "Why the kernel is as it is"): 32 query tokens per prefill
# unit (96 rows of SmolLM2's 3 query heads per kv head share each transposed key tile; faster
# than 16); 32 pages (512 tokens at page size 16) per run of a split decode, enough to spread
# one long decode over the cores.
DEFAULT_BLOCK_Q = 32
DEFAULT_PAGES_PER_SPLIT = 32


def check_supported(*, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int) -> None:
    """The kernel runs every shape the reference runs: ``num_heads`` a multiple of
    ``num_kv_heads`` (a ``ValueError`` otherwise, as for the other kernels)."""
    del head_dim, page_size  # any
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise UnsupportedShapeError("num_heads", num_heads,
                                    f"a multiple of num_kv_heads={num_kv_heads}")


def ragged_paged_attention_cpu(
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
    pages_per_split: int = DEFAULT_PAGES_PER_SPLIT,
    batch_invariant: bool = False,
    interpret: bool = False,
    kv_cache_dtype: jnp.dtype | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Ragged paged attention with the native CPU kernel (arguments as the reference's).

    Args:
      sliding_window: i32[] the layer's window, 0 for full attention: a short request's unit
        starts at the page of its first visible key, a longer one's runs at the first key
        their earliest token sees; the pages before are not read.
      soft_cap: the scores' soft cap (a vectorised tanh in the kernel), or None.
      k_scale, v_scale: f32[] per-tensor scales of the cached keys and values (operands).
      block_q: query tokens per unit of a request longer than 8 tokens.
      pages_per_split: pages per unit of a shorter request (split-K over its context).
      batch_invariant: give each token the same bits whatever chunk it comes in (a decode,
        a whole prompt, the tail after a cached prefix): every unit takes the transposed
        score path and none is split over pages (ragged_paged_attention.cc).
      interpret: ignored (no Pallas here); accepted so that every impl takes the same call.
      kv_cache_dtype: the fp8 dtype whose bits a uint8 ``kv_cache`` holds; None: the cache
        holds values of its own dtype.

    Returns:
      ``(out [T, N, H] in q.dtype, kv_cache [P, L, 2*K, H])``; padding rows of out are zeros.

    Raises:
      native.NativeBuildError: the kernel cannot be built on this machine.
      ValueError: a cache dtype the kernel does not read.
    """
    del interpret
    T, N, H = q.shape
    K = kv_cache.shape[2] // 2
    check_supported(num_heads=N, num_kv_heads=K, head_dim=H, page_size=kv_cache.shape[1])
    kv_cache = write_kv(kv_cache, k, v, slot_mapping, k_scale, v_scale,
                        kv_cache_dtype=kv_cache_dtype)
    values = jnp.dtype(kv_cache_dtype or kv_cache.dtype)
    # Under jax.vmap the kernel runs once per batch element (as the reference's loops would).
    call = jax.ffi.ffi_call(native.target(values),
                            jax.ShapeDtypeStruct((T, N, H), jnp.float32),
                            vmap_method="sequential")
    out = call(q.astype(jnp.float32), kv_cache, block_tables.astype(jnp.int32),
               seq_lens.astype(jnp.int32), query_start_loc.astype(jnp.int32),
               jnp.asarray(num_seqs, jnp.int32), jnp.asarray(sliding_window, jnp.int32),
               jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32),
               sm_scale=np.float32(sm_scale),
               soft_cap=np.float32(soft_cap or 0.0), block_q=np.int64(block_q),
               pages_per_split=np.int64(pages_per_split), batch_invariant=bool(batch_invariant),
               fp8_bits=values.name if values != kv_cache.dtype else "")
    return out.astype(q.dtype), kv_cache
