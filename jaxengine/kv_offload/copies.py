"""Whole KV pages between the device pool and the host: two jitted programs of fixed shape.

`gather` reads `BLOCKS_PER_COPY` pages out of the pool (block ids padded with the null block 0)
into one array with the page axis first, `[M, ...page]` (for the model's `[Ly, P, L, 2K, H]`
pool: `[M, Ly, L, 2K, H]`), so that each page is one contiguous slice on the host. `scatter`
writes such an array back into the pool, which it donates, so the update is in place as in the
model step (docs/JAX_NOTES.md, "Donation"); padding rows write into the null block, which
padding tokens write into anyway. A copy of more pages runs the program several times, so the
two programs are the only ones, compiled once when the engine is built and called as those
executables: a copy never traces or compiles, whatever the workload and whatever array types
the pool comes in. (A pool that a step loaded whole from the compilation cache returns has an
aval unequal to the built pool's, its dtype object being an unpickled copy: jitted, the copy
traced and compiled again on it: docs/JAX_NOTES.md, "Executables saved whole".)

Under tensor parallelism the pool is split over the heads (`kv_cache_sharding`): the gathered
pages keep that split on the device and `jax.device_get` assembles whole pages on the host; the
pages to load are put with the same split moved to their axes, so each device receives only its
heads, and the scatter returns the pool in the sharding it came in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

BLOCKS_PER_COPY = 16  # M: pages per run of either program
GATHER_NAME = "jaxengine_kv_offload_gather"
SCATTER_NAME = "jaxengine_kv_offload_scatter"


def jaxengine_kv_offload_gather(kv: jax.Array, block_ids: jax.Array, *, page_axis: int
                                ) -> jax.Array:
    """Pages `block_ids` (i32[M]) of the pool, page axis first: [M, ...page]."""
    return jnp.moveaxis(jnp.take(kv, block_ids, axis=page_axis), page_axis, 0)


def jaxengine_kv_offload_scatter(kv: jax.Array, block_ids: jax.Array, pages: jax.Array, *,
                                 page_axis: int) -> jax.Array:
    """The pool with pages `block_ids` (i32[M]) replaced by `pages` ([M, ...page])."""
    index = (slice(None),) * page_axis + (block_ids,)
    return kv.at[index].set(jnp.moveaxis(pages, 0, page_axis).astype(kv.dtype))


class BlockCopier:
    """The two copy programs for one KV pool (its shape, dtype, sharding and page axis)."""

    def __init__(self, kv: jax.Array, *, page_axis: int) -> None:
        """Compile both programs for `kv` (ahead of time; every copy calls them).

        Args:
          kv: the pool as the runner holds it.
          page_axis: its axis of pages (`ModelFns.kv_page_axis`).
        """
        self.page_axis = page_axis
        shape = list(kv.shape)
        self.page_shape = tuple(shape[:page_axis] + shape[page_axis + 1:])
        self.dtype = np.dtype(kv.dtype)
        self.page_bytes = int(np.prod(self.page_shape)) * self.dtype.itemsize
        self._pages_sharding = _pages_sharding(kv, page_axis)
        # The pool comes back in the sharding it came in, so its donated buffers are reused
        # and the model step (compiled for that sharding) sees the same array type.
        out = kv.sharding if isinstance(kv.sharding, NamedSharding) else None
        gather = jax.jit(jaxengine_kv_offload_gather, static_argnames=("page_axis",))
        scatter = jax.jit(jaxengine_kv_offload_scatter, static_argnames=("page_axis",),
                          donate_argnames=("kv",), out_shardings=out)
        ids = np.zeros(BLOCKS_PER_COPY, np.int32)
        pages = jax.ShapeDtypeStruct((BLOCKS_PER_COPY, *self.page_shape), self.dtype,
                                     sharding=self._pages_sharding)
        self._gather = gather.lower(kv, ids, page_axis=page_axis).compile()
        self._scatter = scatter.lower(kv, ids, pages, page_axis=page_axis).compile()

    def gather(self, kv: jax.Array, block_ids: np.ndarray) -> jax.Array:
        """Start copying up to M pages out: their [M, ...page] array, its transfer to the host
        started (`np.asarray` of it waits for both).

        Args:
          kv: the pool (not donated: the next model step donates it).
          block_ids: i32[n], n <= M; padded here with the null block.
        """
        pages = self.gather_pages(kv, block_ids)
        pages.copy_to_host_async()
        return pages

    def gather_pages(self, kv: jax.Array, block_ids: np.ndarray) -> jax.Array:
        """Up to M pages out of the pool into an [M, ...page] array that stays on the device
        (split as the pool is; `gather` also starts its copy to the host).

        Args:
          kv: the pool (not donated: the next model step donates it).
          block_ids: i32[n], n <= M; padded here with the null block.
        """
        return self._gather(kv, _padded(block_ids))

    def scatter(self, kv: jax.Array, block_ids: np.ndarray, pages: np.ndarray) -> jax.Array:
        """Write up to M host pages into the pool; returns the new pool (`kv` is donated).

        Args:
          block_ids: i32[n], n <= M, where the pages go.
          pages: [n, ...page] in the pool's dtype.
        """
        padded = np.zeros((BLOCKS_PER_COPY, *self.page_shape), self.dtype)
        padded[: len(pages)] = pages
        # Without a mesh the pages go as numpy, uncommitted as the program was compiled for.
        on_device = (padded if self._pages_sharding is None
                     else jax.device_put(padded, self._pages_sharding))
        return self.scatter_pages(kv, block_ids, on_device)

    def pages_struct(self, device: jax.Device) -> jax.ShapeDtypeStruct:
        """What one copy's [M, ...page] array is on the device, for a transfer into this pool:
        the pool's split (`device`, a pool on no mesh: the one device it lives on)."""
        sharding = self._pages_sharding or jax.sharding.SingleDeviceSharding(device)
        return jax.ShapeDtypeStruct((BLOCKS_PER_COPY, *self.page_shape), self.dtype,
                                    sharding=sharding)

    def scatter_pages(self, kv: jax.Array, block_ids: np.ndarray, pages: jax.Array
                      ) -> jax.Array:
        """Write an [M, ...page] array of pages already on the device into the pool; returns
        the new pool (`kv` is donated).

        Args:
          block_ids: i32[n], n <= M, where pages 0 .. n-1 go (the rest: the null block).
          pages: [M, ...page] in the pool's dtype, split as `pages_struct` says.
        """
        return self._scatter(kv, _padded(block_ids), pages)


def _padded(block_ids: np.ndarray) -> np.ndarray:
    ids = np.zeros(BLOCKS_PER_COPY, np.int32)  # the null block 0 pads
    ids[: len(block_ids)] = block_ids
    return ids


def _pages_sharding(kv: jax.Array, page_axis: int) -> NamedSharding | None:
    """Where a [M, ...page] array of pages lives: the pool's split, its page axis moved first
    (None: a pool on no mesh, e.g. the fake model's)."""
    sharding = kv.sharding
    if not isinstance(sharding, NamedSharding):
        return None
    spec = list(sharding.spec) + [None] * (kv.ndim - len(sharding.spec))
    spec.insert(0, spec.pop(page_axis))
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))
