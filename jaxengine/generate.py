"""`generate`: a fully jit-compiled, fixed-batch generation loop for research code.

No scheduler, no host round trips: one prefill step over all prompts, then a `lax.while_loop`
of decode steps, all traceable, so it can sit inside the caller's own `jax.jit`. It drives the
same pure model step and sampler as the engine, over a private paged KV cache:

- `cache="contiguous"`: sequence b owns pages `1 + b*M ... (b+1)*M` (M pages per sequence), so
  its cache is one contiguous stretch (a `[B, M*L]` cache viewed as pages);
- `cache="paged"`: pages are interleaved across sequences (page j of b is `1 + j*B + b`), the
  scattered layout a paged pool produces.
Both give the same tokens; block 0 is the null page where padding writes.

Prompts are right-aligned in `prompt_ids` rows of width S (left padding); `prompt_lens` says
how many trailing entries are real.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxengine.model.batch import ModelBatch
from jaxengine.model.fns import ModelFns
from jaxengine.sampling.sampler import SamplingMetadata, sample_impl


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """Generated tokens of a fixed batch."""

    tokens: jax.Array  # i32[B, N]  generated ids; after EOS (or beyond the length) = pad_id
    lengths: jax.Array  # i32[B]  tokens generated per row (EOS included)


def _block_tables(B: int, M: int, cache: str) -> jax.Array:
    """i32[B, M] page ids of every sequence (never the null page 0)."""
    b, j = jnp.arange(B)[:, None], jnp.arange(M)[None, :]
    if cache == "contiguous":
        return (1 + b * M + j).astype(jnp.int32)
    if cache == "paged":
        return (1 + j * B + b).astype(jnp.int32)
    raise ValueError(f"cache must be 'contiguous' or 'paged', got {cache!r}")


def _slots(tables: jax.Array, positions: jax.Array, L: int) -> jax.Array:
    """Flat KV slot of each (row, position); negative positions go to the null page."""
    page = jnp.take_along_axis(tables, jnp.maximum(positions, 0) // L, axis=1)
    return jnp.where(positions >= 0, page * L + positions % L, positions % L)


def _metadata(B: int, position: jax.Array, seeds: jax.Array, temperature: Any,
              top_k: Any, top_p: Any) -> SamplingMetadata:
    full = lambda x, dt: jnp.broadcast_to(jnp.asarray(x, dt), (B,))  # noqa: E731
    return SamplingMetadata(
        temperature=full(temperature, jnp.float32), top_k=full(top_k, jnp.int32),
        top_p=full(top_p, jnp.float32), min_p=jnp.zeros(B, jnp.float32), seeds=seeds,
        positions=full(position, jnp.int32), num_logprobs=jnp.full(B, -1, jnp.int32),
        banned_token_ids=jnp.full((B, 1), -1, jnp.int32))


def _prefill(model: ModelFns, params: Any, kv: jax.Array, prompt_ids: jax.Array,
             lens: jax.Array, tables: jax.Array, L: int) -> tuple[jax.Array, jax.Array]:
    """One step over all prompts (B*S tokens, left padding); returns (kv, hidden [B, D])."""
    B, S = prompt_ids.shape
    pos = jnp.arange(S)[None, :] - (S - lens)[:, None]  # i32[B, S]; < 0 on padding
    batch = ModelBatch(
        input_ids=prompt_ids.reshape(-1).astype(jnp.int32),
        positions=jnp.maximum(pos, 0).reshape(-1).astype(jnp.int32),
        slot_mapping=_slots(tables, pos, L).reshape(-1).astype(jnp.int32),
        block_tables=tables, seq_lens=lens.astype(jnp.int32),
        query_start_loc=(jnp.arange(B + 1) * S).astype(jnp.int32),
        num_seqs=jnp.asarray(B, jnp.int32),
        logits_indices=(jnp.arange(B) * S + S - 1).astype(jnp.int32))
    kv, hidden = model.step(params, kv, batch)
    return kv, hidden[batch.logits_indices]


def _decode_batch(tokens: jax.Array, lengths: jax.Array, tables: jax.Array, L: int
                  ) -> ModelBatch:
    """One token per row: `tokens` at position `lengths` (the current context length)."""
    B = tokens.shape[0]
    ar = jnp.arange(B, dtype=jnp.int32)
    return ModelBatch(
        input_ids=tokens, positions=lengths, slot_mapping=_slots(tables, lengths[:, None], L)[:, 0],
        block_tables=tables, seq_lens=lengths + 1,
        query_start_loc=jnp.arange(B + 1, dtype=jnp.int32), num_seqs=jnp.asarray(B, jnp.int32),
        logits_indices=ar)


def generate(model: ModelFns, prompt_ids: jax.Array, prompt_lens: jax.Array | None = None, *,
             max_new_tokens: int, params: Any = None, key: jax.Array | None = None,
             temperature: Any = 0.0, top_k: Any = 0, top_p: Any = 1.0,
             eos_token_id: int | None = None, pad_id: int = 0, cache: str = "contiguous",
             block_size: int = 16) -> GenerateOutput:
    """Generate up to `max_new_tokens` for a fixed batch, entirely on device (jit-able).

    Args:
      model: the model's pure functions (`engine_model.model_fns(...)` or a fake).
      prompt_ids: i32[B, S] prompts, right-aligned (left padding).
      prompt_lens: i32[B] real prompt lengths (default: all S).
      max_new_tokens: N; static (it sets the output shape and the cache size).
      params: the weights (default `model.params`); pass them as a traced argument under jit.
      key: PRNG key for sampling (each row draws from its own seed; default seed 0).
      temperature, top_k, top_p: scalars or [B]; temperature 0 = greedy.
      eos_token_id: a row stops after emitting it (None: never).
      pad_id: fills positions after a row stopped.
      cache: "contiguous" or "paged" page layout (same results).
      block_size: L, tokens per page.
    Returns:
      GenerateOutput(tokens i32[B, N], lengths i32[B]).
    """
    B, S = prompt_ids.shape
    N, L = max_new_tokens, block_size
    params = model.params if params is None else params
    lens = jnp.full(B, S, jnp.int32) if prompt_lens is None else prompt_lens.astype(jnp.int32)
    M = -(-(S + N) // L)
    tables = _block_tables(B, M, cache)
    seeds = (jnp.zeros(B, jnp.uint32) if key is None
             else jax.random.bits(key, (B,), jnp.uint32))

    def draw(params: Any, hidden: jax.Array, position: Any) -> jax.Array:
        md = _metadata(B, position, seeds, temperature, top_k, top_p)
        return sample_impl(model.compute_logits(params, hidden), md, max_logprobs=0).token_ids

    def is_eos(tokens: jax.Array) -> jax.Array:
        return jnp.zeros(B, bool) if eos_token_id is None else tokens == eos_token_id

    kv, hidden = _prefill(model, params, model.init_kv(1 + B * M, L), prompt_ids, lens,
                          tables, L)
    first = draw(params, hidden, 0)
    out = jnp.full((B, N), pad_id, jnp.int32).at[:, 0].set(first)

    def cond(carry: tuple) -> jax.Array:
        i, _, _, _, _, _, done = carry
        return (i < N) & ~jnp.all(done)

    # The weights ride in the carry, unchanged: a scanned model (`nnx.scan` over its layers)
    # refuses weights closed over from outside the loop's trace.
    def body(carry: tuple) -> tuple:
        i, params, kv, out, last, lengths, done = carry
        kv, hidden = model.step(params, kv, _decode_batch(last, lengths, tables, L))
        token = jnp.where(done, pad_id, draw(params, hidden, i))
        out = lax.dynamic_update_index_in_dim(out, token, i, axis=1)
        return i + 1, params, kv, out, token, lengths + 1, done | is_eos(token)

    init = (jnp.asarray(1, jnp.int32), params, kv, out, first, lens, is_eos(first))
    steps, _, _, out, _, _, _ = lax.while_loop(cond, body, init)
    ended = (out == eos_token_id) if eos_token_id is not None else jnp.zeros((B, N), bool)
    lengths = jnp.where(jnp.any(ended, axis=1), jnp.argmax(ended, axis=1) + 1, steps)
    return GenerateOutput(tokens=out, lengths=lengths.astype(jnp.int32))
