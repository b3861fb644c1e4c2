"""What every attention implementation does to a query's scores: which cached keys it sees
(causal, with a sliding window) and Gemma 2's soft cap; and the precision of the jnp oracle's
dots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# The oracle must not lose bits on accelerators (float32 dots default to bf16 passes on TPU and
# TF32 on GPU); on CPU this costs nothing.
HIGHEST = lax.Precision.HIGHEST


def first_visible(pos: jax.Array, sliding_window: jax.Array) -> jax.Array:
    """The first key position a query at ``pos`` sees: ``pos - W + 1`` (W keys, itself
    included, transformers' rule), 0 without a window (``W == 0``) or near the start.

    Args:
      pos: i32[...] query positions.
      sliding_window: i32[] the layer's window W, 0 for full attention.

    Returns:
      i32[...] like ``pos``.
    """
    return jnp.where(sliding_window > 0, jnp.maximum(pos - sliding_window + 1, 0), 0)


def cap_scores(s: jax.Array, soft_cap: float | None) -> jax.Array:
    """Gemma 2's logit soft-capping, ``soft_cap * tanh(s / soft_cap)``; ``s`` as is for None."""
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)
