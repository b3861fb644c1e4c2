"""The paged KV cache: one array for the whole model, passed in and returned by value.

Layout `[num_layers, num_blocks, block_size, 2 * num_kv_heads, head_dim]` (P pages of L slots;
K at even, V at odd head slots, as TPU ragged paged attention expects), in the model dtype.
Block 0 is the null block: padding tokens write there, so the scheduler never hands it out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxengine.model.config import ModelConfig


def kv_cache_shape(cfg: ModelConfig, *, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Shape of the cache for `cfg`: (layers, P, L, 2*K, H)."""
    if num_blocks < 2 or block_size < 1:
        raise ValueError(f"need num_blocks >= 2 (block 0 is the null block) and block_size >= "
                         f"1, got num_blocks={num_blocks}, block_size={block_size}")
    return (cfg.num_layers, num_blocks, block_size, 2 * cfg.num_kv_heads, cfg.head_dim)


def kv_cache_bytes_per_block(cfg: ModelConfig, *, block_size: int, dtype: jnp.dtype) -> int:
    """Bytes one page takes across all layers (`engine.build.num_kv_blocks` sizes the pool)."""
    per_slot = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
    return per_slot * block_size * jnp.dtype(dtype).itemsize


def init_kv_cache(cfg: ModelConfig, *, num_blocks: int, block_size: int,
                  dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """A zeroed cache [layers, P, L, 2*K, H] in `dtype` (the model's dtype)."""
    shape = kv_cache_shape(cfg, num_blocks=num_blocks, block_size=block_size)
    return jnp.zeros(shape, dtype)
