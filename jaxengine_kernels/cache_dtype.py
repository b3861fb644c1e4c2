"""The dtypes a KV cache may hold, and the one rule by which every implementation writes and
reads them (vLLM's ``kv_cache_dtype`` semantics).

A cache may hold float32, bfloat16, float8_e4m3fn (vLLM's ``"fp8"`` / ``"fp8_e4m3"``) or
float8_e5m2 (``"fp8_e5m2"``), whatever the queries' dtype (float32 or bfloat16). Each layer has
two per-tensor float32 scales, ``k_scale`` and ``v_scale``:

- a write stores ``x / scale`` cast to the cache dtype; for fp8 it is first clipped to the
  format's finite range, so a value beyond it saturates to the largest finite value instead of
  becoming inf or NaN (float8_e4m3fn has no inf);
- a read widens the cache to float32 and multiplies by the scale: ``cache.astype(f32) * scale``.

The rule holds in every dtype (a float32 or bfloat16 cache normally has scales of 1.0, which
change nothing), so no implementation has a special case.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CACHE_DTYPES: tuple[jnp.dtype, ...] = tuple(
    jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2)
)
QUERY_DTYPES: tuple[jnp.dtype, ...] = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
FP8_DTYPES: tuple[jnp.dtype, ...] = CACHE_DTYPES[2:]


def check_dtypes(q_dtype: jnp.dtype, cache_dtype: jnp.dtype) -> None:
    """``ValueError`` naming the dtype when the queries or the cache have one not supported.

    Args:
      q_dtype: the queries' (and new keys' and values') dtype: float32 or bfloat16.
      cache_dtype: the cache's, one of ``CACHE_DTYPES``.
    """
    if jnp.dtype(q_dtype) not in QUERY_DTYPES:
        raise ValueError(f"q must be float32 or bfloat16, got {jnp.dtype(q_dtype)}")
    if jnp.dtype(cache_dtype) not in CACHE_DTYPES:
        names = ", ".join(d.name for d in CACHE_DTYPES)
        raise ValueError(f"kv_cache dtype must be one of {names}, got {jnp.dtype(cache_dtype)}")


def check_scale(name: str, scale: float | jax.Array) -> jax.Array:
    """The scale as an f32[] operand; ``ValueError`` naming it for a Python number that is not
    positive and finite (a traced scale is the checkpoint's, checked where it is loaded).

    Args:
      name: ``"k_scale"`` or ``"v_scale"``, for the message.
      scale: a Python number or an f32[] array.
    """
    if isinstance(scale, int | float) and not 0 < scale < float("inf"):
        raise ValueError(f"{name} must be a positive finite float, got {scale!r}")
    return jnp.asarray(scale, jnp.float32).reshape(())


def quantize(x: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``x / scale`` in the cache dtype (float32 arithmetic), clipped to fp8's finite range.

    Args:
      x: keys or values ``[..., H]`` (float32 or bfloat16).
      scale: f32[] the per-tensor scale.
      dtype: the cache dtype (one of ``CACHE_DTYPES``).

    Returns:
      ``x``'s shape in ``dtype``.
    """
    y = x.astype(jnp.float32) / scale
    if jnp.dtype(dtype) in FP8_DTYPES:
        bound = float(jnp.finfo(dtype).max)
        y = jnp.clip(y, -bound, bound)
    return y.astype(dtype)


def dot_dtype(q_dtype: jnp.dtype, cache_dtype: jnp.dtype) -> jnp.dtype:
    """The dtype a Pallas kernel's dots take for these queries and this cache: float32 if
    either is float32, else bfloat16 (which holds every fp8 value exactly)."""
    f32 = jnp.dtype(jnp.float32)
    return f32 if f32 in (jnp.dtype(q_dtype), jnp.dtype(cache_dtype)) else jnp.dtype(jnp.bfloat16)


def dequantize(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x.astype(float32) * scale``: the value a cache entry stands for.

    Args:
      x: cache entries in any of ``CACHE_DTYPES``.
      scale: f32[] the per-tensor scale.

    Returns:
      float32, ``x``'s shape.
    """
    return x.astype(jnp.float32) * scale
