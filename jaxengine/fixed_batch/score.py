"""`score`: the log-likelihood of given continuations of given prompts, in one jitted step.

For research loops (evaluation, preference data, reranking): each row's prompt and
continuation go through the model together in one prefill step over a private paged KV cache
(`jaxengine.fixed_batch.layout`), and every continuation token's logprob is read from the raw model
distribution at the position before it, the same distribution `generate` reports logprobs of.
Like `generate`, it runs a `jax.jit` program itself (`jaxengine_score`, jitted once per model)
and is traceable inside the caller's jit; its retrace rules are `generate`'s: the shapes
(B, S, C), `cache`, `block_size` and the model are static, the weights and every id and length
value are traced.

It is differentiable w.r.t. `params` in reverse mode (`jax.grad`, `jax.vjp`), on every
attention backend: the kernels carry their own backward (jaxengine_kernels). `logprobs` and
`total` carry gradients; `is_greedy` (an argmax) does not. This is how to train on what
`generate` produced: generate, then differentiate the score of its tokens
(`notebooks/gradients.ipynb` trains the embedded model so, then serves the weights with
`LLM.update_weights`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxengine.fixed_batch.layout import (
    block_tables,
    check_layout,
    check_rows,
    pages_per_row,
    prefill,
)
from jaxengine.fixed_batch.programs import program_for
from jaxengine.model.fns import ModelFns
from jaxengine.sampling.argmax import argmax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScoreOutput:
    """Log-likelihood of each row's continuation given its prompt."""

    logprobs: jax.Array  # f32[B, C]  raw logprob of continuation token j; 0 past its length
    total: jax.Array  # f32[B]  sum over the continuation (its log-likelihood)
    is_greedy: jax.Array  # bool[B]  every continuation token is the argmax (lm-eval's name)


def score(model: ModelFns, prompt_ids: jax.Array, continuation_ids: jax.Array,
          prompt_lens: jax.Array | None = None, continuation_lens: jax.Array | None = None, *,
          params: Any = None, cache: str = "contiguous", block_size: int = 16) -> ScoreOutput:
    """Score `continuation_ids` after `prompt_ids`, row by row (jit-able).

    Args:
      model: the model's pure functions (`load_model_fns(path)`, `model_fns_of(llm)`).
      prompt_ids: i32[B, S] prompts, right-aligned (left padding, as for `generate`).
      continuation_ids: i32[B, C] continuations, left-aligned (right padding).
      prompt_lens: i32[B] real prompt lengths in [1, S] (default: all S).
      continuation_lens: i32[B] real continuation lengths in [1, C] (default: all C).
      params: the weights (default `model.params`); pass them as a traced argument under jit.
      cache, block_size: the private cache's page layout and page size, as for `generate`.
    Returns:
      ScoreOutput(logprobs f32[B, C], total f32[B], is_greedy bool[B]); `logprobs` and
      `total` are differentiable w.r.t. `params` (`jax.grad` of a loss of them), `is_greedy`
      is not.
    Raises:
      ValueError: bad shapes, or (when concrete) ids or lengths out of range.
    """
    check_layout(cache, block_size)
    prompt_ids, continuation_ids = jnp.asarray(prompt_ids), jnp.asarray(continuation_ids)
    p_lens = None if prompt_lens is None else jnp.asarray(prompt_lens)
    c_lens = None if continuation_lens is None else jnp.asarray(continuation_lens)
    check_rows("prompt_ids", prompt_ids, p_lens, model.vocab_size)
    check_rows("continuation_ids", continuation_ids, c_lens, model.vocab_size)
    (B, S), (Bc, C) = prompt_ids.shape, continuation_ids.shape
    if Bc != B:
        raise ValueError(f"prompt_ids has {B} rows but continuation_ids has {Bc}; give one "
                         f"continuation per prompt")
    p_lens = jnp.full(B, S, jnp.int32) if p_lens is None else p_lens.astype(jnp.int32)
    c_lens = jnp.full(B, C, jnp.int32) if c_lens is None else c_lens.astype(jnp.int32)
    program = program_for(jaxengine_score, model, static_argnames=("cache", "block_size"))
    return program(
        model.params if params is None else params, prompt_ids.astype(jnp.int32),
        continuation_ids.astype(jnp.int32), p_lens, c_lens, cache=cache, block_size=block_size)


# Jitted per model by `program_for` (its functions bound, static), the cache layout static.
def jaxengine_score(params: Any, prompt_ids: jax.Array, continuation_ids: jax.Array,
                    prompt_lens: jax.Array, continuation_lens: jax.Array, *,
                    step_fn: Callable, logits_fn: Callable, init_kv_fn: Callable, cache: str,
                    block_size: int) -> ScoreOutput:
    """The compiled step behind `score` (its arguments already arrays of fixed shapes)."""
    (B, S), C = prompt_ids.shape, continuation_ids.shape[1]
    M = pages_per_row(S + C, block_size)
    tables = block_tables(B, M, cache)
    # One row: left padding, the prompt, the continuation, its right padding. The padding on
    # the right counts as context (positions past the continuation), and is never read.
    rows = jnp.concatenate([prompt_ids, continuation_ids], axis=1)  # i32[B, S + C]
    _, hidden = prefill(step_fn, params, init_kv_fn(1 + B * M, block_size), rows,
                        prompt_lens + C, tables, block_size)  # [B, S + C, D]
    before = hidden[:, S - 1:S - 1 + C]  # [B, C, D]  the position before each token
    logits = logits_fn(params, before.reshape(B * C, -1)).astype(jnp.float32)  # f32[B*C, V]
    raw = jax.nn.log_softmax(logits, axis=-1).reshape(B, C, -1)
    lp = jnp.take_along_axis(raw, continuation_ids[:, :, None], axis=-1)[:, :, 0]  # f32[B, C]
    live = jnp.arange(C)[None, :] < continuation_lens[:, None]  # bool[B, C]
    lp = jnp.where(live, lp, 0.0)
    greedy = argmax(raw) == continuation_ids
    return ScoreOutput(logprobs=lp, total=lp.sum(axis=1),
                       is_greedy=jnp.all(greedy | ~live, axis=1))
