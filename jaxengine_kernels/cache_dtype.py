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

On the CPU an fp8 cache is stored as its bits, a uint8 array of the same shape, and the
kernels are told which format the bytes hold (``storage_dtype``): XLA on CPU cannot scatter
into an fp8 array in place (it converts the whole operand and back, hundreds of ms a layer for
a large pool) but scatters into a donated uint8 array in place. The jnp reference and the CPU
kernel take such a cache; the Pallas kernels keep real fp8 arrays, which XLA on TPU and GPU
scatters natively.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CACHE_DTYPES: tuple[jnp.dtype, ...] = tuple(
    jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2)
)
QUERY_DTYPES: tuple[jnp.dtype, ...] = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
FP8_DTYPES: tuple[jnp.dtype, ...] = CACHE_DTYPES[2:]
# The dtype of an fp8 cache stored as its bits, and the implementations that read one.
BITS_DTYPE = jnp.dtype(jnp.uint8)
BITS_IMPLS: tuple[str, ...] = ("reference", "cpu")


def storage_dtype(cache_dtype: jnp.dtype, *, impl: str, platform: str) -> jnp.dtype:
    """The dtype an engine's cache array of ``cache_dtype`` values has: ``BITS_DTYPE`` for fp8
    read by an implementation of ``BITS_IMPLS`` on the "cpu" platform, else ``cache_dtype``.

    Args:
      cache_dtype: the values' dtype, one of ``CACHE_DTYPES``.
      impl: the attention implementation ("reference", "cpu", "tpu", "gpu").
      platform: the jax platform the cache lives on (``jax.Device.platform``).
    """
    fp8 = jnp.dtype(cache_dtype) in FP8_DTYPES
    return BITS_DTYPE if fp8 and impl in BITS_IMPLS and platform == "cpu" else jnp.dtype(
        cache_dtype)


def values_dtype(stored: jnp.dtype, kv_cache_dtype: jnp.dtype | None, impl: str) -> jnp.dtype:
    """The dtype of the values a cache array of dtype ``stored`` holds, checked.

    Args:
      stored: the cache array's dtype.
      kv_cache_dtype: the values' dtype when given: an fp8 dtype for a ``BITS_DTYPE`` array,
        else ``stored`` itself; None: ``stored``.
      impl: the implementation that reads it.

    Raises:
      ValueError: naming the values, for a uint8 cache without an fp8 ``kv_cache_dtype`` or
        read by an implementation that does not take bits, or a ``kv_cache_dtype`` that is
        not the array's.
    """
    stored = jnp.dtype(stored)
    if stored != BITS_DTYPE:
        if kv_cache_dtype is not None and jnp.dtype(kv_cache_dtype) != stored:
            raise ValueError(f"kv_cache_dtype={jnp.dtype(kv_cache_dtype)} does not match the "
                             f"{stored} kv_cache; it names the values of a uint8 cache of fp8 "
                             f"bits only")
        return stored
    fp8 = ", ".join(d.name for d in FP8_DTYPES)
    if kv_cache_dtype is None or jnp.dtype(kv_cache_dtype) not in FP8_DTYPES:
        got = None if kv_cache_dtype is None else jnp.dtype(kv_cache_dtype)
        raise ValueError(f"a uint8 kv_cache holds fp8 bits and needs kv_cache_dtype naming "
                         f"their format ({fp8}), got kv_cache_dtype={got}")
    if impl not in BITS_IMPLS:
        raise ValueError(f"impl={impl!r} reads a real {jnp.dtype(kv_cache_dtype)} kv_cache, not "
                         f"its bits in uint8 (only {', '.join(BITS_IMPLS)} do)")
    return jnp.dtype(kv_cache_dtype)


def from_bits(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Cache entries ``x`` as values of ``dtype``: bitcast when ``x`` holds their bits
    (uint8), else ``x`` itself. Only what an implementation has gathered goes through it,
    never a whole cache."""
    if x.dtype == BITS_DTYPE and jnp.dtype(dtype) != BITS_DTYPE:
        return jax.lax.bitcast_convert_type(x, dtype)
    return x


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
