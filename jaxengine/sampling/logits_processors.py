"""Penalties, `logit_bias`, `allowed_token_ids` and bad words, applied to a batch's logits.

vLLM V1's order (`vllm/v1/sample/sampler.py`): the allow-list and bad words (-inf), min_tokens'
bans (-inf, in `sampler.py` here), `logit_bias` (added), then the penalties:

- repetition: for a token of the prompt or the output, a positive logit is divided by the
  penalty and a negative one multiplied by it;
- frequency: minus the penalty times the token's count in the output;
- presence: minus the penalty once if the token occurs in the output.

Presence and frequency count output tokens only. The -inf entries stay -inf through all of
it, so the allow-list and one-token bad words ride in the additive bias row
(`request_tables.py`). A batch where no row uses any of this skips it at run time.

Axis names: R rows, V vocabulary, S table slots, W armed bad-word bans per row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxengine.sampling.bad_words import MAX_BAD_WORD_BANS, BadWordBan
from jaxengine.sampling.request_tables import RequestTables
from scheduler import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LogitsAdjustments:
    """Per-row inputs of this file for one batch (padding rows: slot -1, nothing armed)."""

    slots: jax.Array  # i32[R]  row of the RequestTables; -1: the request has none
    presence_penalty: jax.Array  # f32[R]  0 = off
    frequency_penalty: jax.Array  # f32[R]  0 = off
    repetition_penalty: jax.Array  # f32[R]  1 = off
    ban_ids: jax.Array  # i32[R, W]  armed bad-word tokens (W = MAX_BAD_WORD_BANS); -1 = unused
    ban_after: jax.Array  # i32[R, W]  ... banned only if the token in flight is this; -1 = always
    prev_rows: jax.Array  # i32[R]  the row's entry in the step in flight's tokens; -1: none


def build_adjustments(params: Sequence[SamplingParams], slots: Sequence[int],
                      bans: Sequence[Sequence[BadWordBan]], prev_rows: Sequence[int],
                      num_rows: int, *, max_bans: int = MAX_BAD_WORD_BANS) -> LogitsAdjustments:
    """Pack one batch's rows into numpy arrays of size `num_rows` (R, the request bucket).

    Args:
      params, slots, bans, prev_rows: one entry per sampling row, in order (slot -1: none;
        prev row -1: no token in flight for it).
      num_rows: R.
      max_bans: W.
    Raises:
      ValueError: a row with more than `max_bans` armed bans (the engine's check prevents it).
    """
    adj = LogitsAdjustments(
        slots=np.full(num_rows, -1, np.int32),
        presence_penalty=np.zeros(num_rows, np.float32),
        frequency_penalty=np.zeros(num_rows, np.float32),
        repetition_penalty=np.ones(num_rows, np.float32),
        ban_ids=np.full((num_rows, max_bans), -1, np.int32),
        ban_after=np.full((num_rows, max_bans), -1, np.int32),
        prev_rows=np.full(num_rows, -1, np.int32))
    for i, (sp, slot, row_bans, prev) in enumerate(zip(params, slots, bans, prev_rows,
                                                       strict=True)):
        adj.slots[i], adj.prev_rows[i] = slot, prev
        adj.presence_penalty[i] = sp.presence_penalty
        adj.frequency_penalty[i] = sp.frequency_penalty
        adj.repetition_penalty[i] = sp.repetition_penalty
        if len(row_bans) > max_bans:
            raise ValueError(f"{len(row_bans)} bad-word bans armed in one row, at most "
                             f"{max_bans} fit")
        for j, ban in enumerate(row_bans):
            adj.ban_ids[i, j], adj.ban_after[i, j] = ban.token_id, ban.after
    return adj


def apply_penalties(logits: jax.Array, bias: jax.Array, prompt_mask: jax.Array,
                    output_counts: jax.Array, adj: LogitsAdjustments) -> jax.Array:
    """Bias, then repetition, frequency and presence penalties (f32[R, V]; the table rows
    already gathered per row: f32/bool/i32[R, V])."""
    logits = logits + bias
    seen = prompt_mask | (output_counts > 0)
    rep = jnp.where(seen, adj.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - adj.frequency_penalty[:, None] * output_counts.astype(jnp.float32)
    return logits - adj.presence_penalty[:, None] * (output_counts > 0).astype(jnp.float32)


def apply_logits_processors(logits: jax.Array, tables: RequestTables, adj: LogitsAdjustments,
                            prev_tokens: jax.Array) -> jax.Array:
    """The processed logits of this file, f32[R, V]; unchanged rows cost nothing extra when no
    row in the batch has a slot or an armed ban.

    Args:
      logits: f32[R, V].
      tables: the runner's tables (f32/bool/i32[S, V]).
      adj: the rows' inputs (arrays of size R).
      prev_tokens: i32[R'] tokens of the step in flight (read at `adj.prev_rows`).
    """
    has_slot = adj.slots >= 0  # bool[R]

    def with_tables(x: jax.Array) -> jax.Array:
        rows = jnp.maximum(adj.slots, 0)
        got = apply_penalties(x, tables.bias[rows], tables.prompt_mask[rows],
                              tables.output_counts[rows], adj)
        return jnp.where(has_slot[:, None], got, x)

    def with_bans(x: jax.Array) -> jax.Array:
        R, V = x.shape
        inflight = jnp.where(adj.prev_rows >= 0, prev_tokens[jnp.maximum(adj.prev_rows, 0)], -1)
        armed = (adj.ban_ids >= 0) & ((adj.ban_after < 0) | (adj.ban_after == inflight[:, None]))
        idx = jnp.where(armed, adj.ban_ids, V)  # out of range: dropped by the scatter
        return x.at[jnp.arange(R)[:, None], idx].set(-jnp.inf, mode="drop")

    logits = lax.cond(jnp.any(adj.ban_ids >= 0), with_bans, lambda x: x, logits)
    return lax.cond(jnp.any(has_slot), with_tables, lambda x: x, logits)
