"""Per-channel symmetric weight quantization: int8 or fp8 (e4m3) values with float32 scales.

A weight w is stored as values q and one scale per output channel, w ~= q * scale, with
scale = max|w| / qmax over the channel (the contracted axis): 127 for int8 (q rounded to the
nearest integer), 448 for float8_e4m3fn (q rounded to the nearest fp8 number), and 1 for an
all-zero channel (the vocabulary's padding rows). The same code runs on the host in numpy (the
loader, one tensor at a time) and on the device in jax.numpy (a fresh model's weights), so
both give the same values.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ChannelFormat:
    """One way to store a weight: values of `dtype` with per-channel float32 scales."""

    name: str  # the `quantization` value that selects it
    dtype: np.dtype  # the values' storage type
    qmax: float  # the largest magnitude a value takes: a channel's max|w| maps to it


INT8 = ChannelFormat(name="int8", dtype=np.dtype(np.int8), qmax=127.0)
FP8 = ChannelFormat(name="fp8", dtype=np.dtype(ml_dtypes.float8_e4m3fn), qmax=448.0)


def quantize(w: Any, fmt: ChannelFormat, *, axis: int, xp: ModuleType = np
             ) -> tuple[Any, Any]:
    """(values, scale) of weight `w` with one scale per channel: `axis` is the contracted one.

    Args:
        w: [..., in, out] a kernel (axis=-2: one scale per output column), or [V, D] an
            embedding (axis=-1: one scale per row).
        xp: numpy (host) or jax.numpy (device).
    Returns:
        values in `fmt.dtype`, w's shape; scale f32, w's shape without `axis`.
    """
    w32 = xp.asarray(w).astype(np.float32)
    amax = xp.max(xp.abs(w32), axis=axis)
    # A product by the float32 reciprocal: numpy and XLA round it alike (XLA may turn a
    # division by a constant into one, rounding differently from numpy's division).
    scale = xp.where(amax > 0, amax * np.float32(1 / fmt.qmax), 1.0).astype(np.float32)
    scaled = w32 / xp.expand_dims(scale, axis)
    if fmt.dtype == np.int8:
        scaled = xp.clip(xp.round(scaled), -fmt.qmax, fmt.qmax)
    return scaled.astype(fmt.dtype), scale


def dequantize(values: Any, scale: Any, *, axis: int, dtype: jnp.dtype) -> Any:
    """values * scale (broadcast over `axis`, as `quantize` made them) in `dtype`, computed in
    float32."""
    return (values.astype(jnp.float32) * jnp.expand_dims(scale, axis)).astype(dtype)
