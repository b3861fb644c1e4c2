"""Grouped matmul: rows sorted by group, each group multiplied by its own weight matrix.

``grouped_matmul(x, w, group_sizes)`` computes ``out[r] = x[r] @ w[g(r)]`` where rows
``offsets[g] <= r < offsets[g] + group_sizes[g]`` belong to group g (``offsets`` the exclusive
cumulative sum of ``group_sizes``). Rows past ``sum(group_sizes)`` belong to no group and come
out zero, so a caller drops rows by counting them out. A mixture-of-experts layer runs its
(token, expert) pairs through it, sorted by expert (jaxengine/model/moe.py).

Layout: x [M, D] rows sorted by group; w [E, D, F]; group_sizes i32[E] (traced: any sizes, one
compilation); out [M, F]. Products accumulate in float32; the result is in
``preferred_element_type`` (default x's dtype).

Three implementations:

- ``"xla"``: ``jax.lax.ragged_dot``, which TPU and GPU lower to a grouped kernel.
- ``"native"``: for CPU in float32, a C++ kernel over XLA FFI (``cpu/grouped_matmul.cc``)
  that reads each chosen group's matrix in place and no other.
- ``"tiles"``: XLA operations for CPU where the native kernel is not built, and for other
  dtypes than float32 (XLA's CPU backend expands ``ragged_dot`` to about the cost of every group
  on every row, docs/BENCHMARKS.md §11). Loops whose trip counts are traced run the groups that
  have rows, and in each one B-row tile at a time (the last one masked), so the work is that of
  the rows present rounded up to B per group, and a group without rows never reads its weights.

All three are differentiable in x and w: ``ragged_dot`` is, and the other two are
``jax.custom_vjp``s whose backward is ``ragged_dot``'s VJP, run by XLA (dx = dy @ w[g].T per
group, dw[g] = x_g.T @ dy_g; rows past the groups get none).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

from jaxengine_kernels import cpu
from jaxengine_kernels.cpu import native

GroupedImpl = Literal["xla", "native", "tiles"]
GROUPED_IMPLS: tuple[str, ...] = ("xla", "native", "tiles")
MAX_TILE = 64  # rows per tile once groups are large (64, 128 and 256 measured alike)


def default_grouped_impl(platform: str | None = None, dtype: jnp.dtype = jnp.float32
                         ) -> GroupedImpl:
    """The implementation for a jax platform and the operands' dtype: ``"xla"`` on tpu and
    gpu; on cpu ``"native"`` for float32 where the native library builds, else ``"tiles"``.

    Args:
        platform: a ``jax.default_backend()`` name; default: ``jax.default_backend()``.
        dtype: the dtype of x and w.
    """
    platform = jax.default_backend() if platform is None else platform
    if platform != "cpu":
        return "xla"
    native_ok = jnp.dtype(dtype) == jnp.float32 and cpu.available() is None
    return "native" if native_ok else "tiles"


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
        impl: ``"xla"``, ``"native"`` (float32 only) or ``"tiles"``; default:
            `default_grouped_impl()` for x's dtype.
        preferred_element_type: the result's dtype; default x's.
    Returns:
        [M, F], products accumulated in float32.
    Raises:
        ValueError: an unknown `impl`, shapes that do not match, or ``"native"`` with other
            operands than float32.
        NativeBuildError: ``"native"`` where the native library cannot be built.
    """
    impl = default_grouped_impl(dtype=x.dtype) if impl is None else impl
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
    kernel = _native if impl == "native" else _tiles
    return _with_ragged_dot_backward(kernel, x, w, group_sizes).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _with_ragged_dot_backward(kernel: Callable[..., jax.Array], x: jax.Array, w: jax.Array,
                              group_sizes: jax.Array) -> jax.Array:
    """``kernel(x, w, group_sizes)`` f32[M, F], differentiable: the backward is the VJP of
    ``jax.lax.ragged_dot`` (the "xla" implementation's own), run by XLA."""
    return kernel(x, w, group_sizes)


def _ragged_fwd(kernel, x, w, group_sizes):
    # The output is the custom_vjp's own: a second derivative takes this rule again.
    return _with_ragged_dot_backward(kernel, x, w, group_sizes), (x, w, group_sizes)


def _ragged_bwd(kernel, residuals, dy):
    del kernel
    x, w, group_sizes = residuals
    _, vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(
        x, w, group_sizes, preferred_element_type=jnp.float32), x, w)
    return (*vjp(dy), None)


_with_ragged_dot_backward.defvjp(_ragged_fwd, _ragged_bwd)


def _native(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The "native" implementation: f32[M, F] from the C++ kernel."""
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"grouped matmul impl='native' takes float32, got x {x.dtype} and "
                         f"w {w.dtype}; use impl='tiles'")
    call = jax.ffi.ffi_call(native.grouped_target(),
                            jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32))
    return call(x, w, group_sizes)


def _tiles(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The "tiles" implementation (module docstring), f32[M, F]: a loop over the groups that
    have rows, and inside it one masked B-row tile per iteration.

    The group's matrix is sliced out of `w` once per group: XLA's CPU dot reads a dynamic
    slice only after copying it, so a copy per tile would double the weight traffic.
    """
    M, E, F = x.shape[0], w.shape[0], w.shape[2]
    B = tile_rows(M, E)
    starts = jnp.cumsum(group_sizes) - group_sizes  # i32[E] first row of each group
    num_active = jnp.sum(group_sizes > 0)
    active = jnp.nonzero(group_sizes > 0, size=E, fill_value=0)[0]  # i32[E] first num_active
    # B rows of padding after the last: a tile's slice never runs off the end, which would
    # make dynamic_slice shift its start back onto rows of another group.
    xp = jnp.pad(x, ((0, B), (0, 0)))  # [M + B, D]
    row_in_tile = jnp.arange(B)[:, None]  # [B, 1]

    def group(i: jax.Array, out: jax.Array) -> jax.Array:  # out f32[M + B, F]
        g = active[i]
        wg, size, start = w[g], group_sizes[g], starts[g]  # wg [D, F]

        def tile(j: jax.Array, out: jax.Array) -> jax.Array:
            first = start + j * B
            xt = jax.lax.dynamic_slice_in_dim(xp, first, B)  # [B, D]
            y = jnp.dot(xt, wg, preferred_element_type=jnp.float32)  # f32[B, F]
            old = jax.lax.dynamic_slice_in_dim(out, first, B)
            mine = row_in_tile < size - j * B  # the group's last tile is partial
            return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine, y, old), first,
                                                       axis=0)

        return jax.lax.fori_loop(0, -(-size // B), tile, out)

    out = jax.lax.fori_loop(0, num_active, group, jnp.zeros((M + B, F), jnp.float32))
    return out[:M]
