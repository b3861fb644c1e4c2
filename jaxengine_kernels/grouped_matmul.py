"""Grouped matmul: rows sorted by group, each group multiplied by its own weight matrix.

``grouped_matmul(x, w, group_sizes)`` computes ``out[r] = x[r] @ w[g(r)]`` where rows
``offsets[g] <= r < offsets[g] + group_sizes[g]`` belong to group g (``offsets`` the exclusive
cumulative sum of ``group_sizes``). Rows past ``sum(group_sizes)`` belong to no group and come
out zero, so a caller drops rows by counting them out. A mixture-of-experts layer runs its
(token, expert) pairs through it, sorted by expert (jaxengine/model/moe.py).

Layout: x [M, D] rows sorted by group; w [E, D, F]; group_sizes i32[E] (traced: any sizes, one
compilation); out [M, F]. Products accumulate in float32; the result is in
``preferred_element_type`` (default x's dtype).

Two implementations:

- ``"xla"``: ``jax.lax.ragged_dot``, which TPU and GPU lower to a grouped kernel.
- ``"tiles"``: for CPU, where XLA expands ``ragged_dot`` to about the cost of every group on
  every row (docs/BENCHMARKS.md §11). A loop whose trip count is traced runs one B-row tile of
  one group at a time, tiles existing only where a group has rows (a group's last tile masked),
  so the work is that of the rows present rounded up to B per group, and a group without rows
  never reads its weights.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

GroupedImpl = Literal["xla", "tiles"]
GROUPED_IMPLS: tuple[str, ...] = ("xla", "tiles")
MAX_TILE = 64  # rows per tile once groups are large: the CPU's dot runs near its peak at 64


def default_grouped_impl(platform: str | None = None) -> GroupedImpl:
    """The implementation for a jax platform: ``"tiles"`` on cpu, ``"xla"`` elsewhere.

    Args:
        platform: a ``jax.default_backend()`` name; default: ``jax.default_backend()``.
    """
    platform = jax.default_backend() if platform is None else platform
    return "tiles" if platform == "cpu" else "xla"


def tile_rows(num_rows: int, num_groups: int) -> int:
    """B, the rows of a tile for M rows in E groups: the mean group size rounded up to a power
    of two, between 8 and `MAX_TILE` (small batches pad a group's one tile less)."""
    mean = -(-num_rows // num_groups)
    return min(MAX_TILE, max(8, 1 << (mean - 1).bit_length()))


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   impl: GroupedImpl | None = None,
                   preferred_element_type: jnp.dtype | None = None) -> jax.Array:
    """Multiply each group of rows of `x` by its group's matrix of `w`.

    Args:
        x: [M, D] rows sorted by group.
        w: [E, D, F] one matrix per group.
        group_sizes: i32[E] rows of each group; their sum may be less than M (the rows after
            it come out zero), never more.
        impl: ``"xla"`` or ``"tiles"``; default: `default_grouped_impl()`.
        preferred_element_type: the result's dtype; default x's.
    Returns:
        [M, F], products accumulated in float32.
    Raises:
        ValueError: an unknown `impl`, or shapes that do not match.
    """
    impl = default_grouped_impl() if impl is None else impl
    if impl not in GROUPED_IMPLS:
        raise ValueError(f"grouped matmul impl={impl!r} is unknown; use one of {GROUPED_IMPLS}")
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_matmul needs x [M, D] and w [E, D, F]; got x {x.shape}, "
                         f"w {w.shape}")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"group_sizes has shape {group_sizes.shape}; w has {w.shape[0]} "
                         f"groups")
    out_dtype = x.dtype if preferred_element_type is None else preferred_element_type
    group_sizes = group_sizes.astype(jnp.int32)
    if impl == "xla":
        out = jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)
        return out.astype(out_dtype)
    return _tiles(x, w, group_sizes, out_dtype)


def _tile_plan(group_sizes: jax.Array, tile: int, max_tiles: int
               ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The tiles that cover the groups' rows, in row order.

    Returns:
        (num_tiles i32[], group i32[max_tiles], first row i32[max_tiles], rows i32[max_tiles]):
        tile t < num_tiles multiplies rows first[t] .. first[t] + rows[t] - 1 (rows <= tile)
        by w[group[t]]; entries from num_tiles on are unused.
    """
    tiles = -(-group_sizes // tile)  # i32[E] tiles of each group
    tile_end = jnp.cumsum(tiles)  # i32[E] exclusive end of each group's tiles
    row_start = jnp.cumsum(group_sizes) - group_sizes  # i32[E] first row of each group
    t = jnp.arange(max_tiles, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), group_sizes.shape[0] - 1)
    j = t - (tile_end[group] - tiles[group])  # the tile's index inside its group
    first = row_start[group] + j * tile
    rows = jnp.clip(group_sizes[group] - j * tile, 0, tile)
    return tile_end[-1], group.astype(jnp.int32), first.astype(jnp.int32), rows.astype(jnp.int32)


def _tiles(x: jax.Array, w: jax.Array, group_sizes: jax.Array, out_dtype: jnp.dtype
           ) -> jax.Array:
    """The "tiles" implementation (module docstring): one masked B-row tile per iteration."""
    M, E, F = x.shape[0], w.shape[0], w.shape[2]
    B = tile_rows(M, E)
    # Each group adds at most one partial tile: M // B + E tiles cover any sizes summing to M.
    num_tiles, group, first, rows = _tile_plan(group_sizes, B, M // B + E)
    # B rows of padding after the last: a tile's slice never runs off the end, which would
    # make dynamic_slice shift its start back onto rows of another tile.
    xp = jnp.pad(x, ((0, B), (0, 0)))  # [M + B, D]
    row_in_tile = jnp.arange(B)[:, None]  # [B, 1]

    def body(t: jax.Array, out: jax.Array) -> jax.Array:  # out f32[M + B, F]
        xt = jax.lax.dynamic_slice_in_dim(xp, first[t], B)  # [B, D]
        y = jnp.dot(xt, w[group[t]], preferred_element_type=jnp.float32)  # f32[B, F]
        old = jax.lax.dynamic_slice_in_dim(out, first[t], B)
        return jax.lax.dynamic_update_slice_in_dim(
            out, jnp.where(row_in_tile < rows[t], y, old), first[t], axis=0)

    out = jax.lax.fori_loop(0, num_tiles, body, jnp.zeros((M + B, F), jnp.float32))
    return out[:M].astype(out_dtype)
