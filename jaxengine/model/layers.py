"""Leaf layers of the Llama-family decoder as pure functions of plain arrays.

They take plain numbers and arrays (no config), so tests can build them alone. Numerics follow
HF transformers: norms and RoPE tables in float32, results cast back to the activation dtype.
Axes: T tokens, D model, N query heads, K kv heads, H head dim, F MLP width.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.model.config import RopeScaling


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, as HF Llama does it (normalise in f32, scale in x's dtype).

    Args:
        x: [..., D] activations.
        weight: [D] scale.
    Returns:
        [..., D] in x's dtype.
    """
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse RoPE frequencies f32[H/2], with llama3 scaling applied when given."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv.astype(np.float32)
    if scaling.kind == "linear":
        return (inv / scaling.factor).astype(np.float32)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin f32[T, H] for `positions` i32[T] (HF's non-interleaved half layout)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [T, H]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [T, heads, H] by the tables cos/sin f32[T, H]; result in x's dtype."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def gated_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU MLP: x [T, D], w_gate/w_up [D, F], w_down [F, D] -> [T, D]."""
    gate = jnp.einsum("td,df->tf", x, w_gate)
    up = jnp.einsum("td,df->tf", x, w_up)
    return jnp.einsum("tf,fd->td", jax.nn.silu(gate) * up, w_down)
