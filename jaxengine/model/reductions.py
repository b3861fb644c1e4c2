"""Sums over the last axis in an order fixed by that axis's length: a row's result does not
depend on how many rows are beside it or where it sits among them.

XLA's CPU backend picks a reduction's loop by the whole operand's shape, so one row's sum
rounds differently in a [1, D] batch and a [64, D] one: RMSNorm's mean over SmolLM2's 576
features changed at 8 rows, a sampler row's log-softmax over 256 logits between the 8- and
16-row buckets, and a decode's hidden state moved by up to 6e-6 between the token buckets 4
and 8, which flips a seeded draw now and then. These sums are elementwise adds in a fixed
order instead (`fixed_order_sum`), which XLA may fuse and vectorize but never reorders:
`WIDTH` running sums a row, each adding one chunk after the next, then halved pairwise.
SmolLM2's model steps of 1 to 2048 tokens and its sampler cost what they cost with XLA's
sums, within the noise (docs/DESIGN.md, "Batch invariance").

Axis names: V (or D) the summed axis; `...` any leading axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

WIDTH = 16  # running sums a row: one AVX-512 vector of float32
MAX_CHUNKS = 64  # chunks added one after another; wider rows widen the chunk instead


# Jitted so that a step traces it once per shape, not at each call (two a layer): tracing its
# unrolled adds was most of a warm start's precompile (docs/BENCHMARKS.md §14). XLA inlines
# the call: the same adds in the same order.
@jax.jit
def fixed_order_sum(x: jax.Array) -> jax.Array:
    """x [..., V] -> [...]: each row's sum, in an order that depends on V alone.

    Chunks of `width` values (16, doubled until at most `MAX_CHUNKS` chunks cover V; zeros
    pad the last) are added one after another into `width` running sums, which are then
    added pairwise in halves.
    """
    n = x.shape[-1]
    width = WIDTH
    while -(-n // width) > MAX_CHUNKS:
        width *= 2
    chunks = -(-n // width)
    pad = [(0, 0)] * (x.ndim - 1) + [(0, chunks * width - n)]
    parts = jnp.pad(x, pad).reshape(*x.shape[:-1], chunks, width)
    acc = parts[..., 0, :]
    for i in range(1, chunks):
        acc = acc + parts[..., i, :]
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc[..., 0]


def softmax(x: jax.Array) -> jax.Array:
    """`jax.nn.softmax(x, axis=-1)` with its sum taken by `fixed_order_sum`."""
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    return e / fixed_order_sum(e)[..., None]


def log_softmax(x: jax.Array) -> jax.Array:
    """`jax.nn.log_softmax(x, axis=-1)` with its sum taken by `fixed_order_sum`."""
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return shifted - jnp.log(fixed_order_sum(jnp.exp(shifted)))[..., None]
