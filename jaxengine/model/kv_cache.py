"""The paged KV cache: one array for the whole model, passed in and returned by value.

Layout `[num_layers, num_blocks, block_size, 2 * num_kv_heads, head_dim]` (P pages of L slots;
K at even, V at odd head slots, as TPU ragged paged attention expects), in the KV cache dtype:
the model's, or the engine's `kv_cache_dtype` (bfloat16, or float8 holding k / k_scale; the
attention kernel quantizes on write and dequantizes on read).
Block 0 is the null block: padding tokens write there, so the scheduler never hands it out.
The engine's pool is `grouped`: its leading axis is the layer slots of the model's KV cache
groups (`kv_groups.kv_cache_layout`), the layers themselves for a model of one group.

Under tensor parallelism the head axis is split over the mesh axis "tp" (K, V pairs stay
together: device d holds heads d*K/tp.. of both); K is then the model's laid-out count K'
(`TPLayout.num_kv_heads`, KV heads repeated when tp > K), so each device holds 1/min(tp, K)
of the checkpoint's cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxengine.model.config import ModelConfig
from jaxengine.model.kv_groups import kv_cache_layout
from jaxengine.model.mesh import TP_AXIS, make_mesh

KV_CACHE_SPEC = P(None, None, None, TP_AXIS, None)  # [layers, P, L, 2*K, H]: split on heads


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """The cache's sharding on `mesh`: the head axis split over "tp"."""
    return NamedSharding(mesh, KV_CACHE_SPEC)


def kv_cache_layers(cfg: ModelConfig, *, grouped: bool = False) -> int:
    """The cache's leading axis: `cfg`'s layers, or with `grouped` the layer slots of its KV
    cache groups (a page holds one group's layers)."""
    return kv_cache_layout(cfg).num_slots if grouped else cfg.num_layers


def kv_cache_shape(cfg: ModelConfig, *, num_blocks: int, block_size: int,
                   num_kv_heads: int | None = None, grouped: bool = False) -> tuple[int, ...]:
    """Shape of the cache for `cfg`: (layers, P, L, 2*K, H).

    Args:
        num_kv_heads: K as the model lays it out (default: the config's).
        grouped: lay the layers out by KV cache group (`kv_cache_layers`).
    """
    if num_blocks < 2 or block_size < 1:
        raise ValueError(f"need num_blocks >= 2 (block 0 is the null block) and block_size >= "
                         f"1, got num_blocks={num_blocks}, block_size={block_size}")
    K = num_kv_heads or cfg.num_kv_heads
    return (kv_cache_layers(cfg, grouped=grouped), num_blocks, block_size, 2 * K, cfg.head_dim)


def kv_cache_bytes_per_block(cfg: ModelConfig, *, block_size: int, dtype: jnp.dtype,
                             num_kv_heads: int | None = None, shards: int = 1,
                             grouped: bool = False) -> int:
    """Bytes one page takes across all its layers on each device (`create_engine_config`
    sizes the pool from one device's budget).

    Args:
        num_kv_heads: K as the model lays it out (default: the config's).
        shards: devices the head axis is split over (the tp size).
        grouped: a page of the KV cache groups' layout (`kv_cache_layers`).
    """
    K = num_kv_heads or cfg.num_kv_heads
    per_slot = kv_cache_layers(cfg, grouped=grouped) * 2 * (K // shards) * cfg.head_dim
    return per_slot * block_size * jnp.dtype(dtype).itemsize


def init_kv_cache(cfg: ModelConfig, *, num_blocks: int, block_size: int,
                  dtype: jnp.dtype = jnp.float32, num_kv_heads: int | None = None,
                  mesh: Mesh | None = None, grouped: bool = False) -> jax.Array:
    """A zeroed cache [layers, P, L, 2*K, H] in `dtype` (the KV cache dtype), made in place
    with `kv_cache_sharding(mesh)`: each device zeroes only its own heads.

    Args:
        num_kv_heads: K as the model lays it out (default: the config's).
        mesh: the model's mesh (default: a mesh of jax's first device, as `Model`'s).
        grouped: the KV cache groups' layout, for batches with `group_block_tables`.
    """
    shape = kv_cache_shape(cfg, num_blocks=num_blocks, block_size=block_size,
                           num_kv_heads=num_kv_heads, grouped=grouped)
    mesh = mesh or make_mesh(jax.devices()[:1])
    return _zeros(shape, jnp.dtype(dtype), kv_cache_sharding(mesh))


# A jit whose output has the cache's sharding, rather than `jnp.zeros(..., device=)`: the
# same in-place zeroing on a concrete mesh, and it also traces inside `generate` / `score`
# on an abstract mesh of Auto axes (lowering for devices this machine lacks), where
# `jnp.zeros` refuses an Auto axis in its sharding.
@functools.partial(jax.jit, static_argnames=("shape", "dtype", "sharding"))
def _zeros(shape: tuple[int, ...], dtype: jnp.dtype, sharding: NamedSharding) -> jax.Array:
    return jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), sharding)
