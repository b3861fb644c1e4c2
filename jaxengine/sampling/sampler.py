"""Token sampling on device: one batch, per-request parameters.

Every request row carries its own temperature, top-k, top-p, min-p, seed and output position,
as fixed-size arrays (R = the request bucket), so one compiled function serves any mix of
greedy and random requests. The PRNG key of a row is derived from `(seed, output position)`
only, never from a batch-global key: the same seed gives the same tokens whatever the batch
mates are, and a preempted-and-resumed request redraws exactly what it drew before. The
softmaxes' sums run in an order fixed by V (`jaxengine.model.reductions`): a row's
probabilities and logprobs do not depend on its batch mates or the request bucket either.

Order of the transforms (as vLLM V1): temperature, then top-k, top-p and min-p on the scaled
distribution. Logprobs (the sampled token's and the top-n) are those of the raw model output,
before any of these transforms, which is vLLM's default (`logprobs_mode="raw_logprobs"`).
Penalties, `logit_bias`, `allowed_token_ids` and bad words come in through `adjust`
(`logits_processors.py`), before the temperature, as in vLLM.

Axis names: R requests (rows), V vocabulary, n top logprobs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxengine.model.reductions import softmax
from jaxengine.sampling.argmax import argmax
from jaxengine.sampling.token_logprobs import token_logprobs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling parameters of one batch (padding rows are greedy, no filtering)."""

    temperature: jax.Array  # f32[R]  0 = greedy (argmax)
    top_k: jax.Array  # i32[R]  0 = off
    top_p: jax.Array  # f32[R]  1 = off; in (0, 1]
    min_p: jax.Array  # f32[R]  0 = off; in [0, 1]
    seeds: jax.Array  # u32[R]  per-request seed
    positions: jax.Array  # i32[R]  output index of the token being drawn (folded into the key)
    num_logprobs: jax.Array  # i32[R]  top logprobs wanted; -1 = no logprobs at all
    banned_token_ids: jax.Array  # i32[R, S]  never drawn this step (min_tokens); -1 = unused


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """Sampled tokens and their raw logprobs."""

    token_ids: jax.Array  # i32[R]
    logprobs: jax.Array  # f32[R]  raw logprob of the sampled token (0 if nobody asked)
    top_logprobs: jax.Array  # f32[R, n]  best n raw logprobs, descending (zeros if none asked)
    top_token_ids: jax.Array  # i32[R, n]
    ranks: jax.Array  # i32[R]  sampled token's rank: 1 + tokens more likely (0 if none asked)


def row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """Key of each row: `fold_in(key(seed), position)`.

    Args:
      seeds: u32[R]. positions: i32[R].
    Returns:
      key[R] typed PRNG keys.
    """
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)


def _filter_mask(scaled: jax.Array, md: SamplingMetadata) -> jax.Array:
    """bool[R, V]: tokens allowed by top-k, then top-p, then min-p (on scaled logits)."""
    R, V = scaled.shape
    order = jnp.argsort(-scaled, axis=-1)  # i32[R, V]  descending
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)  # f32[R, V]
    rank = lax.broadcasted_iota(jnp.int32, (R, V), 1)
    k = jnp.where(md.top_k > 0, jnp.minimum(md.top_k, V), V)  # i32[R]
    keep = rank < k[:, None]
    # top-p on the top-k renormalised distribution: keep a token if the mass strictly before
    # it is below top_p (the most likely token is always kept).
    masked = jnp.where(keep, sorted_logits, -jnp.inf)
    probs = softmax(masked)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_before < md.top_p[:, None]
    # min-p: p_i >= min_p * p_max  <=>  logit_i - logit_max >= log(min_p); a ratio, so it does
    # not matter whether the distribution was renormalised first.
    log_min_p = jnp.log(jnp.maximum(md.min_p, 1e-30))[:, None]
    keep &= (md.min_p[:, None] <= 0) | (sorted_logits - sorted_logits[:, :1] >= log_min_p)
    keep = keep.at[:, 0].set(True)
    rows = jnp.arange(R)[:, None]
    return jnp.zeros((R, V), bool).at[rows, order].set(keep)


def _sample_random(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """i32[R]: a draw from each row's filtered, temperature-scaled distribution."""
    V = logits.shape[-1]
    t = jnp.where(md.temperature > 0, md.temperature, 1.0)
    scaled = logits / t[:, None]
    needs_filter = jnp.any((md.top_k > 0) | (md.top_p < 1.0) | (md.min_p > 0.0))
    # The sort behind top-k/top-p is the expensive part: skip it at run time when no row asks.
    allowed = lax.cond(
        needs_filter,
        lambda: _filter_mask(scaled, md),
        lambda: jnp.ones(scaled.shape, bool),
    )
    # Inverse-CDF draw: one uniform per row instead of V Gumbel variates (the RNG dominates the
    # cost on CPU otherwise). Disallowed tokens have zero mass, so the search skips them.
    probs = softmax(jnp.where(allowed, scaled, -jnp.inf))  # f32[R, V]
    cdf = jnp.cumsum(probs, axis=-1)
    keys = row_keys(md.seeds, md.positions)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32, minval=1e-7))(keys)  # f32[R]
    token = jnp.sum(cdf < (u * cdf[:, -1])[:, None], axis=-1)
    # Rounding can push the search past the last token with mass: clamp to it.
    last = V - 1 - argmax(jnp.flip(probs > 0, axis=-1))
    return jnp.minimum(token, last).astype(jnp.int32)


def _ban(logits: jax.Array, banned: jax.Array) -> jax.Array:
    """Set banned tokens to -inf (how `min_tokens` keeps EOS and stop ids out, as vLLM does)."""
    R, V = logits.shape
    idx = jnp.where(banned < 0, V, banned)  # out of range: dropped by the scatter
    return logits.at[jnp.arange(R)[:, None], idx].set(-jnp.inf, mode="drop")


def _logprobs(
    logits: jax.Array, tokens: jax.Array, md: SamplingMetadata, n: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Raw logprob and rank of each sampled token and the top n, computed only if some row
    asks: (f32[R], i32[R], f32[R, n], i32[R, n])."""
    R = logits.shape[0]

    def compute() -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        return token_logprobs(logits, tokens, n)

    def skip() -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        zeros = jnp.zeros((R, n), jnp.float32)
        return (jnp.zeros(R, jnp.float32), jnp.zeros(R, jnp.int32), zeros,
                jnp.zeros((R, n), jnp.int32))

    return lax.cond(jnp.any(md.num_logprobs >= 0), compute, skip)


def sample_impl(logits: jax.Array, md: SamplingMetadata, *, max_logprobs: int,
                adjust: Callable[[jax.Array], jax.Array] | None = None) -> SamplerOutput:
    """Draw one token per row; traced inside the caller's jit (the runner's, `generate`'s).

    Args:
      logits: f32/bf16[R, V] model output at each row's last scheduled token.
      md: the rows' sampling parameters (arrays of size R).
      max_logprobs: n, the size of the top-logprobs output (static for the caller's jit: it
        sets an output shape).
      adjust: f32[R, V] -> f32[R, V], applied after min_tokens' bans and before drawing
        (the runner's penalties, biases and bad words, `logits_processors.py`); the logprobs
        do not see it, as vLLM's raw logprobs do not.
    Returns:
      SamplerOutput with token ids i32[R], raw logprobs f32[R], top-n f32/i32[R, n] and the
      sampled tokens' ranks i32[R].
    """
    raw = _ban(logits.astype(jnp.float32), md.banned_token_ids)
    logits = raw if adjust is None else adjust(raw)
    greedy = argmax(logits)
    drawn = lax.cond(
        jnp.all(md.temperature <= 0), lambda: greedy, lambda: _sample_random(logits, md)
    )
    tokens = jnp.where(md.temperature <= 0, greedy, drawn)
    token_lp, rank, top_lp, top_ids = _logprobs(raw, tokens, md, max_logprobs)
    return SamplerOutput(tokens, token_lp, top_lp, top_ids, rank)
