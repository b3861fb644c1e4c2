"""Prompt logprobs on the device: every batch position's raw logprob of the token after it.

vLLM's `SamplingParams.prompt_logprobs`: for prompt token j > 0, its logprob given tokens
0..j-1, its rank, and the top-k of that distribution. Position p of a prompt predicts token
p + 1, so a chunk's last position predicts the next chunk's first token; the host knows the
whole prompt and passes each position's target id (`targets`, -1 where nobody asked), which
makes chunked prefill no different from one chunk.

It runs inside the model step on the hidden states of every scheduled token, under a
`lax.cond` on "some position has a target", so a step without prompt-logprobs requests pays
nothing at run time. The outputs have fixed shapes (T positions, k = the engine's
`max_logprobs`), so a step with them is the same program as one without. Logits are computed
`ROWS_PER_BLOCK` positions at a time (`lax.map`), so the step's memory grows by a block's
[rows, V] logits, not [T, V]. Logprobs are raw (`log_softmax` of the model's logits in f32),
as the sampler reports them (vLLM's `logprobs_mode="raw_logprobs"`).

Axis names: T tokens (batch positions), D model width, V vocabulary, k top logprobs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxengine.sampling.token_logprobs import token_logprobs

ROWS_PER_BLOCK = 256  # positions whose logits are live at once


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """Each batch position's raw logprob of its target token, its rank, and the top k
    (zeros at positions without a target, and everywhere when no position has one)."""

    logprobs: jax.Array  # f32[T]  of the target token
    ranks: jax.Array  # i32[T]  1 + the tokens strictly more likely than the target
    top_token_ids: jax.Array  # i32[T, k]  best first
    top_logprobs: jax.Array  # f32[T, k]


def prompt_logprobs(logits_fn: Callable[[Any, jax.Array], jax.Array], params: Any,
                    hidden: jax.Array, targets: jax.Array, *, num_top: int) -> PromptLogprobs:
    """Prompt logprobs of the positions with a target, computed only if there is one.

    Args:
      logits_fn: the model's `compute_logits(params, hidden [N, D]) -> f32[N, V]`.
      params: its weights.
      hidden: [T, D] final-norm hidden states of every batch position.
      targets: i32[T] the token id each position predicts; -1: no prompt logprob there.
      num_top: k, the width of the top-k outputs (static: it sets their shape).
    Returns:
      PromptLogprobs of T positions.
    """
    T = hidden.shape[0]

    def skip(hidden: jax.Array, targets: jax.Array) -> PromptLogprobs:
        del hidden, targets
        return PromptLogprobs(jnp.zeros(T, jnp.float32), jnp.zeros(T, jnp.int32),
                              jnp.zeros((T, num_top), jnp.int32),
                              jnp.zeros((T, num_top), jnp.float32))

    def compute(hidden: jax.Array, targets: jax.Array) -> PromptLogprobs:
        return prompt_logprobs_impl(logits_fn, params, hidden, targets, num_top=num_top)

    return lax.cond(jnp.any(targets >= 0), compute, skip, hidden, targets)


def prompt_logprobs_impl(logits_fn: Callable[[Any, jax.Array], jax.Array], params: Any,
                         hidden: jax.Array, targets: jax.Array, *,
                         num_top: int) -> PromptLogprobs:
    """`prompt_logprobs` without the skip: every position, `ROWS_PER_BLOCK` at a time."""
    T, D = hidden.shape
    rows = min(T, ROWS_PER_BLOCK)
    blocks = -(-T // rows)
    pad = blocks * rows - T
    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(blocks, rows, D)
    t = jnp.pad(targets, (0, pad), constant_values=-1).reshape(blocks, rows)

    def block(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        h, t = args  # [rows, D], i32[rows]
        valid = t >= 0
        lp, rank, top_lp, top_ids = token_logprobs(logits_fn(params, h), jnp.maximum(t, 0),
                                                   num_top)  # f32[rows], i32[rows], [rows, k]
        return (jnp.where(valid, lp, 0.0), jnp.where(valid, rank, 0),
                jnp.where(valid[:, None], top_ids, 0), jnp.where(valid[:, None], top_lp, 0.0))

    lp, rank, top_ids, top_lp = lax.map(block, (h, t))
    return PromptLogprobs(lp.reshape(-1)[:T], rank.reshape(-1)[:T],
                          top_ids.reshape(-1, num_top)[:T], top_lp.reshape(-1, num_top)[:T])
