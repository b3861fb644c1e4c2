"""Per-request rows on the device for penalties, `logit_bias`, `allowed_token_ids`, bad words.

A request that uses any of them gets a row (a slot) of three tables of fixed shape [S, V]
(S = the runner's `max_num_seqs`), written once when it first samples and freed when the
scheduler reports it finished:

- `bias`: its `logit_bias`, with -inf at tokens outside `allowed_token_ids` and at single-token
  bad words (both are -inf in vLLM too, and -inf plus a bias stays -inf, so one additive row
  is exact);
- `prompt_mask`: the tokens of its prompt (the repetition penalty counts them);
- `output_counts`: how often each token occurs in its output so far. The sampler adds each
  step's token on the device, so a step packed while the previous one is in flight (async
  scheduling) still counts that step's token, which the host does not have yet.

The per-step cost is then independent of the sequence length: the host sends one slot index per
row, the device gathers the rows it needs (only when some row has a slot). The alternative,
padded per-step token lists, would send i32[R, max_model_len] from the host every step.

Axis names: S slots (requests), V vocabulary, R rows of a sampling batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from scheduler import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RequestTables:
    """The device tables (see the module docstring); passed by value and donated."""

    bias: jax.Array  # f32[S, V]  added to the logits; -inf: never drawn
    prompt_mask: jax.Array  # bool[S, V]  token occurs in the prompt
    output_counts: jax.Array  # i32[S, V]  occurrences in the output so far


def uses_table(sp: SamplingParams, bad_words_token_ids: Sequence[Sequence[int]]) -> bool:
    """Whether a request needs a table row: a penalty, a bias, an allow-list or a one-token
    bad word (longer bad words are banned per step, without the tables)."""
    return (sp.presence_penalty != 0 or sp.frequency_penalty != 0
            or sp.repetition_penalty != 1 or bool(sp.logit_bias)
            or sp.allowed_token_ids is not None
            or any(len(w) == 1 for w in bad_words_token_ids))


def init_tables(num_slots: int, vocab_size: int) -> RequestTables:
    """Empty tables as numpy arrays (the runner puts them on its device)."""
    return RequestTables(bias=np.zeros((num_slots, vocab_size), np.float32),
                         prompt_mask=np.zeros((num_slots, vocab_size), bool),
                         output_counts=np.zeros((num_slots, vocab_size), np.int32))


def slot_rows(sp: SamplingParams, prompt_token_ids: Sequence[int],
              output_token_ids: Sequence[int], bad_words_token_ids: Sequence[Sequence[int]],
              vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A request's rows of `bias` (f32[V]), `prompt_mask` (bool[V]) and `output_counts`
    (i32[V], of the outputs the host has), built on the host."""
    bias = np.zeros(vocab_size, np.float32)
    if sp.logit_bias:
        bias[list(sp.logit_bias)] = list(sp.logit_bias.values())
    if sp.allowed_token_ids is not None:
        allowed = np.zeros(vocab_size, bool)
        allowed[list(sp.allowed_token_ids)] = True
        bias[~allowed] = -np.inf
    single = [w[0] for w in bad_words_token_ids if len(w) == 1]
    bias[single] = -np.inf
    prompt = np.zeros(vocab_size, bool)
    prompt[np.asarray(prompt_token_ids, np.int64)] = True
    counts = np.bincount(np.asarray(output_token_ids, np.int64),
                         minlength=vocab_size).astype(np.int32)
    return bias, prompt, counts


def write_slot(tables: RequestTables, slot: jax.Array, bias: jax.Array, prompt_mask: jax.Array,
               output_counts: jax.Array, prev_tokens: jax.Array, prev_row: jax.Array
               ) -> RequestTables:
    """Give slot `slot` (i32[]) its request's rows (f32/bool/i32[V]). `prev_row` (i32[], -1:
    none) is the request's entry in `prev_tokens` (i32[R], the step in flight): an output
    the host does not have yet, counted here."""
    inflight = prev_tokens[jnp.maximum(prev_row, 0)]
    counts = output_counts.at[inflight].add(jnp.where(prev_row >= 0, 1, 0))
    return RequestTables(bias=tables.bias.at[slot].set(bias),
                         prompt_mask=tables.prompt_mask.at[slot].set(prompt_mask),
                         output_counts=tables.output_counts.at[slot].set(counts))


def record_tokens(tables: RequestTables, slots: jax.Array, tokens: jax.Array) -> RequestTables:
    """Count each row's sampled token in its slot's output (slots i32[R], -1: no slot;
    tokens i32[R])."""
    S = tables.output_counts.shape[0]
    rows = jnp.where(slots < 0, S, slots)  # out of range: dropped by the scatter
    counts = tables.output_counts.at[rows, tokens].add(1, mode="drop")
    return dataclasses.replace(tables, output_counts=counts)
