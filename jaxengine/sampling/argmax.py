"""`argmax` over the last axis as two plain reductions, for the vocabulary-wide argmaxes of a step.

`jnp.argmax` lowers to one variadic (value, index) reduce, which XLA's CPU backend runs as a
scalar loop over greedy decoding's [R, V] logits, several times slower than a max and then the
first index that holds it (docs/BENCHMARKS.md §2, "Other work in a step"). The result is
jnp.argmax's, ties and NaNs included: the first index of the largest value, or of the first
NaN when there is one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def argmax(x: jax.Array) -> jax.Array:
    """i32[...]: the index of the largest entry of x[..., V] along its last axis (the first
    of equal ones; the first NaN if any), as ``jnp.argmax(x, axis=-1)``."""
    best = jnp.max(x, axis=-1, keepdims=True)  # NaN if the row holds one
    iota = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    hit = x == best
    if jnp.issubdtype(x.dtype, jnp.floating):
        hit |= jnp.isnan(x)
    return jnp.min(jnp.where(hit, iota, x.shape[-1]), axis=-1)
