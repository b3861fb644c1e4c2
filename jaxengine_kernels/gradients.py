"""Reverse mode through ragged paged attention, whichever implementation runs the forward.

``with_backward(forward, ...)`` is a ``jax.custom_vjp``: its forward is the chosen kernel as it
runs without gradients (the native CPU call, a Pallas kernel, the jnp reference: same bits,
same speed), and its backward is the VJP of one jnp formulation of the same maths,
``differentiable.ragged_paged_attention_differentiable`` (static trip counts, recomputed chunk
by chunk), run by XLA. So the Pallas kernels on TPU and GPU have no backward kernel of their own:
their backward is this XLA program.

Cotangents: q, k, v, and the input cache, which receives the output cache's cotangent where
the step did not overwrite it, and through the scatter of the new rows, k and v receive both
the output cache's cotangent at their slots and this step's reads of them. So in a
``generate``-like loop a later step's read of what an earlier step wrote reaches the earlier
step's k and v. The integer operands get none (float0), and so do ``k_scale``, ``v_scale``
and the window: the scales are treated as constants.

A quantized cache of real values (bfloat16, float8) is differentiated straight through its
rounding: the derivative of a write is that of ``x / scale`` clipped to the format's range (1 /
scale inside it, 0 for a saturated value); the cache's cotangent is in the cache's dtype (the
backward adds up what its reads contribute in float32 and rounds once). A
uint8 cache of fp8 bits cannot carry a cotangent (an integer array), so what one step writes
could pass no gradient to the next: taking a gradient through one is a ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxengine_kernels.cache_dtype import BITS_DTYPE
from jaxengine_kernels.differentiable import ragged_paged_attention_differentiable

# The differentiable operands: q, k, v, kv_cache; the rest (slot_mapping, block_tables,
# seq_lens, query_start_loc, num_seqs, sliding_window, k_scale, v_scale) get no cotangent.
_NUM_DIFFERENTIABLE = 4


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Backward:
    """The static arguments of the backward formulation."""

    sm_scale: float  # the softmax scale
    soft_cap: float | None  # the scores' soft cap, or None
    kv_cache_dtype: jnp.dtype  # the values the cache holds (its dtype, or fp8 for uint8 bits)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def with_backward(
    forward: Callable[..., tuple[jax.Array, jax.Array]],
    backward: Backward,
    *operands: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """``forward(*operands)`` with the backward of the jnp formulation.

    Args:
      forward: an implementation taking the operands positionally: q [T, N, H], k and v
        [T, K, H], kv_cache [P, L, 2*K, H], slot_mapping, block_tables, seq_lens,
        query_start_loc, num_seqs, sliding_window i32[], k_scale and v_scale f32[]; returns
        ``(out [T, N, H], kv_cache)``.
      backward: the formulation's static arguments.
      *operands: those operands.

    Returns:
      ``forward(*operands)``.

    Raises:
      ValueError: under differentiation, for a uint8 cache of fp8 bits (naming the format).
    """
    return forward(*operands)


def _fwd(forward, backward, *operands):
    kv_cache = operands[3]
    if kv_cache.dtype == BITS_DTYPE:
        raise ValueError(
            f"gradients cannot flow through a uint8 kv_cache of fp8 bits (kv_cache_dtype="
            f"{jnp.dtype(backward.kv_cache_dtype).name}): an integer array carries no "
            f"cotangent from one step to the next; differentiate with a float32 or bfloat16 "
            f"cache, or a {jnp.dtype(backward.kv_cache_dtype).name} array (impl='reference')")
    # The residuals are the operands: the backward recomputes the scores chunk by chunk. The
    # output is with_backward's own, so a second derivative takes this rule again instead of
    # differentiating the kernel.
    return with_backward(forward, backward, *operands), operands


def _bwd(forward, backward, operands, cotangents):
    del forward
    rest = operands[_NUM_DIFFERENTIABLE:]
    *ints, window, k_scale, v_scale = rest

    def formulation(q, k, v, kv_cache):
        return ragged_paged_attention_differentiable(
            q, k, v, kv_cache, *ints, sm_scale=backward.sm_scale, sliding_window=window,
            soft_cap=backward.soft_cap, k_scale=k_scale, v_scale=v_scale)

    _, vjp = jax.vjp(formulation, *operands[:_NUM_DIFFERENTIABLE])
    return (*vjp(cotangents), *(None for _ in rest))


with_backward.defvjp(_fwd, _bwd)
