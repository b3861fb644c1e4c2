"""A fake model whose next token is a known function of its whole input (docs/STYLE.md rule 10).

The step writes each token id into a paged integer "KV cache" at its slot, then computes, for
every token, a hash of all tokens of its request up to its position, read back through the
block table. So a wrong slot mapping, block table, prefix-cache hit or preemption recompute
changes the output, and the expected greedy continuation is `fake_next_token(prompt + outputs)`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxengine.model.batch import ModelBatch
from jaxengine.model.fns import ModelFns, sign

LOGIT = 10.0  # the chosen token's logit; every other token has 0


def fake_next_token(tokens: Sequence[int], vocab_size: int) -> int:
    """The token the fake model puts first after `tokens` (a prompt plus outputs)."""
    s = sum(((i + 1) * t) % vocab_size for i, t in enumerate(tokens))
    return (s * 7 + len(tokens)) % vocab_size


def fake_greedy(prompt: Sequence[int], max_tokens: int, vocab_size: int) -> list[int]:
    """Greedy continuation of one request, computed in Python."""
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(fake_next_token(tokens, vocab_size))
        tokens.append(out[-1])
    return out


def _step(params: dict, kv: jax.Array, batch: ModelBatch, vocab_size: int
          ) -> tuple[jax.Array, jax.Array]:
    """kv i32[P, L] -> (new kv, hidden f32[T, 1] holding each token's successor)."""
    del params
    P, L = kv.shape
    flat = kv.reshape(-1).at[batch.slot_mapping].set(batch.input_ids)
    T = batch.input_ids.shape[0]
    R = batch.block_tables.shape[0]
    t = jnp.arange(T)
    req = jnp.minimum(jnp.searchsorted(batch.query_start_loc[1:], t, side="right"), R - 1)
    table = batch.block_tables[req]  # i32[T, max_blocks]
    slots = (table[:, :, None] * L + jnp.arange(L)).reshape(T, -1)  # i32[T, S]
    ctx = flat[slots]  # i32[T, S]
    pos = jnp.arange(slots.shape[1])
    terms = ((pos + 1)[None, :] * ctx) % vocab_size
    s = jnp.sum(jnp.where(pos[None, :] <= batch.positions[:, None], terms, 0), axis=1)
    nxt = (s * 7 + batch.positions + 1) % vocab_size
    return flat.reshape(P, L), nxt[:, None].astype(jnp.float32)


@functools.cache
def fake_model(vocab_size: int = 97) -> ModelFns:
    """`ModelFns` of the fake model over a `vocab_size` vocabulary.

    Cached: the same object each time, so runners over it share compiled executables.
    """

    def step(params: dict, kv: jax.Array, batch: ModelBatch) -> tuple[jax.Array, jax.Array]:
        return _step(params, kv, batch, vocab_size)

    def compute_logits(params: dict, hidden: jax.Array) -> jax.Array:
        ids = hidden[:, 0].astype(jnp.int32)
        return jnp.where(jnp.arange(vocab_size)[None, :] == ids[:, None], params["logit"], 0.0)

    return ModelFns(
        params={"logit": jnp.float32(LOGIT)},
        step=sign(step, "fake step", vocab_size),
        compute_logits=sign(compute_logits, "fake logits", vocab_size),
        init_kv=lambda num_blocks, block_size: jnp.zeros((num_blocks, block_size), jnp.int32),
        kv_bytes_per_block=lambda block_size: 4 * block_size,
        vocab_size=vocab_size,
        kv_page_axis=0,  # i32[P, L]
    )
