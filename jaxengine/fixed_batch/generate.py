"""`generate`: a fully jit-compiled, fixed-batch generation loop for research code.

No scheduler, no host round trips: one prefill step over all prompts, then a `lax.while_loop`
of decode steps, all traceable, so it can sit inside the caller's own `jax.jit` (or be called
as is: it runs a `jax.jit` program itself, `jaxengine_generate`, jitted once per model and
dropped with it, `jaxengine.fixed_batch.programs`). It drives the same pure model
step and sampler as the engine (`jaxengine.sampling.sampler.sample_impl`), over a private
paged KV cache (`jaxengine.fixed_batch.layout`), and returns each generated token's logprob of
the raw model distribution, as the engine's `SamplingParams(logprobs=...)` does (vLLM's
"raw_logprobs").

Prompts are right-aligned in `prompt_ids` rows of width S (left padding); `prompt_lens` says
how many trailing entries are real. `jaxengine.encode_batch` makes both from strings,
`jaxengine.decode_batch` turns the output back into text, and `jaxengine.load_model_fns` /
`jaxengine.model_fns_of(llm)` give the model.

A row stops after the model's EOS ids (`ModelFns.eos_token_ids`: the tokenizer's, as the engine
stops on them, when the model came with one) unless `eos_token_id` names others;
`eos_token_id=()` never stops on EOS (vLLM's `ignore_eos=True`).

Retrace rules (what makes a new program):
- static, a new program for each new value: the batch size B and prompt width S (shapes: pad
  prompts to a fixed width, `encode_batch(..., width=S)`, to reuse one program),
  `max_new_tokens`, `logprobs` (the top-n count), `cache`, `block_size`, the number of EOS
  ids (none and one are the same program), and the model itself (its functions: config and
  dtype; another model is another program, a copy with other `params` is not);
- traced, any value reuses the program: `params` (weights of the same shapes and dtypes),
  `prompt_ids` and `prompt_lens` values, `key`, the values of `temperature`, `top_k`, `top_p`
  and `min_p` (scalars or [B]; always converted to [B] arrays, so a scalar and an array are
  the same program), the EOS ids' values and `pad_id`.
Under an outer `jax.jit` the same rules hold for the outer program, for the arguments passed
through its traced inputs; a Python value closed over by the outer function is a constant of it.

No output is differentiable w.r.t. `params`: the tokens are sampled, in a `lax.while_loop` of
data-dependent length, and differentiating through the weights raises a `ValueError` that says
so. The logprobs are a function of the weights all the same: score the generated tokens with
`jaxengine.score` (the same raw logprobs) and take gradients of that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxengine.fixed_batch.layout import (
    block_tables,
    check_layout,
    check_rows,
    decode_batch,
    pages_per_row,
    prefill,
)
from jaxengine.fixed_batch.programs import program_for
from jaxengine.model.fns import ModelFns
from jaxengine.sampling.sampler import SamplerOutput, SamplingMetadata, sample_impl


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """Generated tokens of a fixed batch and their raw logprobs.

    Positions a row did not generate (after its EOS, or after the loop ended) hold `pad_id`
    tokens and zero logprobs.
    """

    tokens: jax.Array  # i32[B, N]  generated ids; after EOS (or beyond the length) = pad_id
    lengths: jax.Array  # i32[B]  tokens generated per row (EOS included)
    logprobs: jax.Array  # f32[B, N]  raw logprob of each generated token
    top_logprobs: jax.Array  # f32[B, N, n]  best n raw logprobs per position, descending
    top_token_ids: jax.Array  # i32[B, N, n]  their ids (pad_id where nothing was generated)


def generate(model: ModelFns, prompt_ids: jax.Array, prompt_lens: jax.Array | None = None, *,
             max_new_tokens: int, params: Any = None, key: jax.Array | None = None,
             temperature: Any = 0.0, top_k: Any = 0, top_p: Any = 1.0, min_p: Any = 0.0,
             logprobs: int = 0, eos_token_id: int | Sequence[int] | None = None,
             pad_id: int = 0, cache: str = "contiguous", block_size: int = 16
             ) -> GenerateOutput:
    """Generate up to `max_new_tokens` for a fixed batch, entirely on device (jit-able).

    Args:
      model: the model's pure functions (`load_model_fns(path)`, `model_fns_of(llm)`, or a
        fake).
      prompt_ids: i32[B, S] prompts, right-aligned (left padding).
      prompt_lens: i32[B] real prompt lengths, each in [1, S] (default: all S).
      max_new_tokens: N; static (it sets the output shape and the cache size).
      params: the weights (default `model.params`); pass them as a traced argument under jit.
      key: PRNG key for sampling (each row draws from its own seed; default: seed 0 for all).
      temperature, top_k, top_p, min_p: scalars or [B], as `SamplingParams`; temperature 0 =
        greedy.
      logprobs: n, how many top logprobs to return per position besides the sampled token's
        (vLLM's `SamplingParams.logprobs`); static.
      eos_token_id: an id or ids after which a row stops; None: the model's
        (`model.eos_token_ids`, the tokenizer's EOS ids from `load_model_fns` /
        `model_fns_of`; none for a model without a tokenizer); `()`: never (vLLM's
        `ignore_eos=True`).
      pad_id: fills positions after a row stopped.
      cache: "contiguous" or "paged" page layout (same results).
      block_size: L, tokens per page.
    Returns:
      GenerateOutput(tokens i32[B, N], lengths i32[B], logprobs f32[B, N],
      top_logprobs f32[B, N, n], top_token_ids i32[B, N, n]); none carries gradients (for
      those, `jaxengine.score` the tokens).
    Raises:
      ValueError: a bad argument (checked values: shapes, and ids and lengths when concrete);
        under `jax.grad` (or any autodiff) w.r.t. `params`, one saying to use `score`.
    """
    _check_static(max_new_tokens, logprobs, cache, block_size)
    prompt_ids = jnp.asarray(prompt_ids)
    lens = None if prompt_lens is None else jnp.asarray(prompt_lens)
    check_rows("prompt_ids", prompt_ids, lens, model.vocab_size)
    B, S = prompt_ids.shape
    lens = jnp.full(B, S, jnp.int32) if lens is None else lens.astype(jnp.int32)
    full = lambda x, dt: jnp.broadcast_to(jnp.asarray(x, dt), (B,))  # noqa: E731
    seeds = (jnp.zeros(B, jnp.uint32) if key is None
             else jax.random.bits(key, (B,), jnp.uint32))
    eos = _eos_ids(model.eos_token_ids if eos_token_id is None else eos_token_id)
    program = program_for(jaxengine_generate, model, static_argnames=STATIC)
    return program(
        model.params if params is None else params, prompt_ids.astype(jnp.int32), lens, seeds,
        full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
        full(min_p, jnp.float32), eos, jnp.asarray(pad_id, jnp.int32),
        max_new_tokens=max_new_tokens, logprobs=logprobs, cache=cache, block_size=block_size)


def _eos_ids(ids: int | Sequence[int]) -> jax.Array:
    """i32[E] the ids a row stops after; no EOS is the id -1, which is never drawn: the same
    program as one EOS id."""
    eos = jnp.asarray(ids, jnp.int32).reshape(-1)
    return jnp.full(1, -1, jnp.int32) if eos.size == 0 else eos


def _check_static(max_new_tokens: Any, logprobs: Any, cache: str, block_size: Any) -> None:
    for name, value, low in (("max_new_tokens", max_new_tokens, 1), ("logprobs", logprobs, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low} (it is static: it sets an output "
                             f"shape), got {value!r}")
    check_layout(cache, block_size)


@jax.custom_jvp
def _not_differentiable(params: Any) -> Any:
    """The weights as they are; differentiating through them raises `_NOT_DIFFERENTIABLE`
    (reverse mode would otherwise fail deep inside the loop, naming a while_loop or a
    kernel)."""
    return params


_NOT_DIFFERENTIABLE = (
    "jaxengine.generate is not differentiable w.r.t. the weights: its tokens are sampled, in a "
    "lax.while_loop of data-dependent length. To train on generated tokens, generate them, "
    "then take gradients of jaxengine.score(model, prompt_ids, out.tokens, prompt_lens, "
    "out.lengths, params=params): its logprobs are the same raw logprobs, differentiable.")


@_not_differentiable.defjvp
def _no_tangents(primals: tuple, tangents: tuple) -> tuple:
    del primals, tangents
    raise ValueError(_NOT_DIFFERENTIABLE)


# Static (besides the model's functions, bound per model by `program_for`): what sets the
# output and cache shapes or the loop's structure (N, the top-n count, the page layout and size).
STATIC = ("max_new_tokens", "logprobs", "cache", "block_size")


def jaxengine_generate(params: Any, prompt_ids: jax.Array, lens: jax.Array, seeds: jax.Array,
                       temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                       min_p: jax.Array, eos: jax.Array, pad_id: jax.Array, *,
                       step_fn: Callable, logits_fn: Callable, init_kv_fn: Callable,
                       max_new_tokens: int, logprobs: int, cache: str, block_size: int
                       ) -> GenerateOutput:
    """The loop behind `generate` (its arguments already arrays of fixed shapes), jitted per
    model (`jaxengine.fixed_batch.programs`)."""
    params = _not_differentiable(params)
    B, S = prompt_ids.shape
    N, L, n = max_new_tokens, block_size, logprobs
    M = pages_per_row(S + N, L)
    tables = block_tables(B, M, cache)

    def draw(params: Any, hidden: jax.Array, position: Any) -> SamplerOutput:
        md = SamplingMetadata(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds,
            positions=jnp.full(B, position, jnp.int32),
            num_logprobs=jnp.full(B, n, jnp.int32),  # >= 0: the sampled token's at least
            banned_token_ids=jnp.full((B, 1), -1, jnp.int32))
        return sample_impl(logits_fn(params, hidden), md, max_logprobs=n)

    def is_eos(tokens: jax.Array) -> jax.Array:
        return jnp.any(tokens[:, None] == eos[None, :], axis=1)  # bool[B]

    def record(out: tuple, i: Any, s: SamplerOutput, live: jax.Array) -> tuple:
        """Write step i's draws into the outputs; rows not `live` get padding."""
        tokens, lps, top_lps, top_ids = out
        put = lambda buf, x: lax.dynamic_update_index_in_dim(buf, x, i, axis=1)  # noqa: E731
        tok = jnp.where(live, s.token_ids, pad_id)
        return (put(tokens, tok), put(lps, jnp.where(live, s.logprobs, 0.0)),
                put(top_lps, jnp.where(live[:, None], s.top_logprobs, 0.0)),
                put(top_ids, jnp.where(live[:, None], s.top_token_ids, pad_id))), tok

    kv, hidden = prefill(step_fn, params, init_kv_fn(1 + B * M, L), prompt_ids, lens, tables, L)
    out = (jnp.full((B, N), pad_id, jnp.int32), jnp.zeros((B, N), jnp.float32),
           jnp.zeros((B, N, n), jnp.float32), jnp.full((B, N, n), pad_id, jnp.int32))
    out, first = record(out, 0, draw(params, hidden[:, -1], 0), jnp.ones(B, bool))

    def cond(carry: tuple) -> jax.Array:
        i, *_, done = carry
        return (i < N) & ~jnp.all(done)

    # The weights ride in the carry, unchanged: a scanned model (`nnx.scan` over its layers)
    # refuses weights closed over from outside the loop's trace.
    def body(carry: tuple) -> tuple:
        i, params, kv, out, last, ctx, count, done = carry
        kv, hidden = step_fn(params, kv, decode_batch(last, ctx, tables, L))
        out, token = record(out, i, draw(params, hidden, i), ~done)
        return i + 1, params, kv, out, token, ctx + 1, count + ~done, done | is_eos(token)

    init = (jnp.asarray(1, jnp.int32), params, kv, out, first, lens, jnp.ones(B, jnp.int32),
            is_eos(first))
    *_, out, _, _, count, _ = lax.while_loop(cond, body, init)
    tokens, lps, top_lps, top_ids = out
    return GenerateOutput(tokens=tokens, lengths=count, logprobs=lps, top_logprobs=top_lps,
                          top_token_ids=top_ids)

