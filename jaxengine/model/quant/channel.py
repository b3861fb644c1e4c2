"""Symmetric weight quantization: int8 or fp8 (e4m3) values with float32 scales, one per
output channel or one per group of inputs of each output channel.

A weight w is stored as values q and scales, w ~= q * scale, with scale = max|w| / qmax over a
channel's inputs (the contracted axis) or over each run of `group` of them: 127 for int8 (q
rounded to the nearest integer), 448 for float8_e4m3fn (q rounded to the nearest fp8 number),
and 1 where all are zero (the vocabulary's padding rows). int8 takes groups of 32 inputs
(vLLM's compressed-tensors "group" strategy; GGUF's Q8_0 and Q4 blocks are 32 wide too): per
output channel it misses issue 34's accuracy aim on the default model, groups of 32 meet it
(docs/BENCHMARKS.md §13). A contracted axis split over the mesh takes its groups within each
device's part, so that the scales split with their weights; a part that is not a multiple of
32 inputs (tiny test models, a small model on many devices) takes the largest group dividing
it, gcd(part, 32), finer and never coarser, down to 8; a part without a group of 8 is refused.
The same code runs on the host in numpy (the loader, one tensor at a time) and on the device in
jax.numpy (a fresh model's weights), so both give the same values.
"""

from __future__ import annotations

import dataclasses
import math
from types import ModuleType
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ChannelFormat:
    """One way to store a weight: values of `dtype` with float32 scales."""

    name: str  # the `quantization` value that selects it
    dtype: np.dtype  # the values' storage type
    qmax: float  # the largest magnitude a value takes: a scale's max|w| maps to it
    group: int | None = None  # inputs per scale along the contracted axis; None: all of them
    min_group: int = 8  # the smallest group a size off `group` may take (see `group_of`)

    def group_of(self, size: int) -> int | None:
        """The group of a contracted axis of `size` inputs: gcd(size, `group`) (None: per
        channel). Raises ValueError (see `check`) below `min_group`."""
        if self.group is None:
            return None
        group = math.gcd(size, self.group)
        if group < self.min_group:
            raise ValueError(f"quantization={self.name!r} scales groups of gcd(size, "
                             f"{self.group}) >= {self.min_group} inputs, and a size of {size} "
                             f"is not a multiple of {self.min_group}")
        return group

    def check(self, shape: tuple[int, ...], *, axis: int, shards: int = 1,
              name: str = "weight") -> None:
        """Raise unless `shape`'s contracted `axis`, split in `shards` over the mesh, splits
        into groups (`group_of` of each shard's part).

        Raises:
            ValueError: naming the weight, its shape, the split and the groups.
        """
        try:
            self.group_of(shape[axis] // shards)
        except ValueError as e:
            split = f", {shape[axis] // shards} on each of {shards} devices" if shards > 1 else ""
            raise ValueError(f"{e} ({name} {list(shape)} contracts {shape[axis]} inputs{split}); "
                             f"use quantization=None or 'fp8' (per channel)") from None


INT8 = ChannelFormat(name="int8", dtype=np.dtype(np.int8), qmax=127.0, group=32)
FP8 = ChannelFormat(name="fp8", dtype=np.dtype(ml_dtypes.float8_e4m3fn), qmax=448.0)


def _grouped(w: Any, group: int | None, axis: int, xp: ModuleType) -> Any:
    """`w` with its `axis` [n] split in two, [n / group, group] (axis + 1 the group's inputs);
    w with a unit axis inserted after `axis` when `group` is None (one group of n)."""
    axis %= w.ndim
    n = w.shape[axis]
    g = n if group is None else group
    return xp.reshape(w, (*w.shape[:axis], n // g, g, *w.shape[axis + 1:]))


def quantize(w: Any, fmt: ChannelFormat, *, axis: int, shards: int = 1, xp: ModuleType = np
             ) -> tuple[Any, Any]:
    """(values, scale) of weight `w`, scales over `axis`, the contracted one.

    Args:
        w: [..., in, out] a kernel (axis=-2: scales per output column), or [V, D] an
            embedding (axis=-1: scales per row).
        shards: the parts `axis` is split in over the mesh; groups stay within a part.
        xp: numpy (host) or jax.numpy (device).
    Returns:
        values in `fmt.dtype`, w's shape; scale f32: w's shape without `axis` per channel
        (`fmt.group` None), with `axis` [in / group] in groups (`fmt.group_of(in / shards)`).
    Raises:
        ValueError: `axis` has no group (`ChannelFormat.check`).
    """
    fmt.check(tuple(w.shape), axis=axis, shards=shards)
    axis %= len(w.shape)
    group = fmt.group_of(w.shape[axis] // shards)
    # On the host every pass that makes a new array pays its page faults (the default model's
    # weights are 0.5 GB of float32), so no copy of a float32 w, no |w| array (the largest
    # magnitude is max(max w, -min w)), and numpy rounds and clips in place.
    w32 = _grouped(xp.asarray(w, dtype=np.float32), group, axis, xp)
    amax = xp.maximum(xp.max(w32, axis=axis + 1, keepdims=True),
                      -xp.min(w32, axis=axis + 1, keepdims=True))
    # A product by the float32 reciprocal: numpy and XLA round it alike (XLA may turn a
    # division by a constant into one, rounding differently from numpy's division).
    scale = xp.where(amax > 0, amax * np.float32(1 / fmt.qmax), 1.0).astype(np.float32)
    scaled = w32 / scale
    if fmt.dtype == np.int8 and xp is np:
        scaled = np.clip(np.rint(scaled, out=scaled), -fmt.qmax, fmt.qmax, out=scaled)
    elif fmt.dtype == np.int8:
        scaled = xp.clip(xp.round(scaled), -fmt.qmax, fmt.qmax)
    values = xp.reshape(scaled.astype(fmt.dtype), w.shape)
    scale = xp.squeeze(scale, axis + 1)
    return values, (scale if fmt.group is not None else xp.squeeze(scale, axis))


def dequantize(values: Any, scale: Any, *, axis: int, dtype: jnp.dtype) -> Any:
    """values * scale (broadcast over `axis`, as `quantize` made them: per channel, or in
    groups when `scale` keeps `axis`) in `dtype`, computed in float32."""
    axis %= values.ndim
    group = None if scale.ndim < values.ndim else values.shape[axis] // scale.shape[axis]
    per_group = scale if group is not None else jnp.expand_dims(scale, axis)
    w = _grouped(values.astype(jnp.float32), group, axis, jnp) * jnp.expand_dims(per_group,
                                                                                axis + 1)
    return jnp.reshape(w, values.shape).astype(dtype)
