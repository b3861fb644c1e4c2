"""Draft-model proposals (vLLM's `"method": "draft_model"`): a small model of the target's
vocabulary proposes k tokens greedily, on the device.

The draft model has its own KV pool with the target's block ids (the scheduler's block tables
serve any model), plus `scratch` pages per request row. Each step it replays the target's batch
(same tokens, positions and slots), so its cache holds what the target's holds, drafts the
scheduler later rolls back included: like the target's, those positions are rewritten by the
step that recomputes them. After verification, `jaxengine_draft_propose` runs k greedy steps
from each request's newest token (position P = num_tokens - 1, whose KV neither model has yet):
the blocks its table lacks for P..P+k-1 are that row's scratch pages, so rows never write each
other's pages. A wrong draft only costs acceptance; verification keeps the output exact.

Under async scheduling a plan's inputs hold placeholders (the tokens of the step before, on
the device); by the time a step is collected and replayed they are in the request's history, and
the replay reads them from there. Its proposal then runs k + 1 steps (one program, the size
compiled in warm-up): a request whose plain decode is in flight takes the last k (the first
guesses that decode's token), any other the first k.

Not replayed: KV that arrives without a step (a KV connector's loads): the draft then proposes
from a cache with holes, and fewer drafts are accepted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxengine.config.speculative import SpeculativeConfig
from jaxengine.model.batch import ModelBatch, RequestChunk, pack_batch
from jaxengine.model.fns import ModelFns
from jaxengine.runner.buckets import pick_bucket
from jaxengine.sampling.argmax import argmax
from jaxengine.spec.speculator import Speculator, _Token
from scheduler import PLACEHOLDER_TOKEN_ID, SchedulerOutput

if TYPE_CHECKING:
    from jaxengine.engine.request_state import TrackedRequest
    from jaxengine.runner.runner import Runner

REPLAY_NAME = "jaxengine_draft_replay"
PROPOSE_NAME = "jaxengine_draft_propose"


def jaxengine_draft_replay(params: Any, kv: jax.Array, batch: ModelBatch, *,
                           step_fn: Callable) -> jax.Array:
    """The draft model's step over the target's batch, for its KV only."""
    kv, _ = step_fn(params, kv, batch)
    return kv


def jaxengine_draft_propose(params: Any, kv: jax.Array, tokens: jax.Array,
                            positions: jax.Array, tables: jax.Array, num_rows: jax.Array, *,
                            step_fn: Callable, logits_fn: Callable, k: int, block_size: int
                            ) -> tuple[jax.Array, jax.Array]:
    """k greedy decode steps of every row, one token per row per step.

    Args:
      tokens: i32[R] each row's newest token; positions: i32[R] its position P.
      tables: i32[R, W] block tables, scratch pages past each request's own.
      num_rows: i32[] live rows (first); the others are padding.
    Returns:
      The new cache and the drafts, i32[R, k].
    """
    R = tokens.shape[0]
    live = jnp.arange(R) < num_rows
    qsl = jnp.minimum(jnp.arange(R + 1), num_rows).astype(jnp.int32)

    def body(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
        kv, tok, drafts = carry
        pos = positions + j
        page = jnp.take_along_axis(tables, (pos // block_size)[:, None], axis=1)[:, 0]
        batch = ModelBatch(
            input_ids=tok, positions=jnp.where(live, pos, 0),
            slot_mapping=jnp.where(live, page * block_size + pos % block_size, 0),
            block_tables=tables, seq_lens=jnp.where(live, pos + 1, 0), query_start_loc=qsl,
            num_seqs=num_rows, logits_indices=jnp.arange(R, dtype=jnp.int32))
        kv, hidden = step_fn(params, kv, batch)
        nxt = argmax(logits_fn(params, hidden))
        return kv, nxt, drafts.at[:, j].set(nxt)

    kv, _, drafts = lax.fori_loop(0, k, body, (kv, tokens, jnp.zeros((R, k), jnp.int32)))
    return kv, drafts


# Static: the draft model's functions, k and the page size (shapes and the program itself).
_jitted_replay = jax.jit(jaxengine_draft_replay, static_argnames=("step_fn",),
                         donate_argnames=("kv",))
_jitted_propose = jax.jit(jaxengine_draft_propose,
                          static_argnames=("step_fn", "logits_fn", "k", "block_size"),
                          donate_argnames=("kv",))


class DraftModelSpeculator(Speculator):
    """Proposes with a draft model (see the module docstring); verification is the base's."""

    def __init__(self, config: SpeculativeConfig, draft: ModelFns, runner: Runner, *,
                 max_model_len: int, eos_token_id: int | None,
                 async_scheduling: bool = False) -> None:
        """Allocate the draft's KV pool beside the runner's; its programs compile with the
        runner's (`Runner.precompile_hooks`). Under `async_scheduling` the proposal runs
        k + 1 greedy steps (see the module docstring)."""
        super().__init__(config, max_model_len=max_model_len, eos_token_id=eos_token_id)
        if draft.vocab_size != runner.model.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary "
                             f"({draft.vocab_size}) must be the target's "
                             f"({runner.model.vocab_size})")
        c = runner.config
        self.draft, self.runner = draft, runner
        k, bs = config.num_speculative_tokens + int(async_scheduling), c.block_size
        self.scratch = -(-k // bs) + 1  # pages P..P+k-1 can touch past a row's own
        self.kv = draft.init_kv(c.num_blocks + c.max_num_seqs * self.scratch, bs)
        self._width = c.max_blocks_per_seq + self.scratch
        self._replay = functools.partial(_jitted_replay, step_fn=draft.step)
        self._propose = functools.partial(_jitted_propose, step_fn=draft.step,
                                          logits_fn=draft.compute_logits, k=k, block_size=bs)
        self._tables: Mapping[str, Sequence[int]] = {}
        runner.precompile_hooks.append(self.precompile)

    def precompile(self) -> None:
        """Compile the replay for every token bucket and the proposal steps."""
        c = self.runner.config
        for size in self.runner.token_buckets:
            self.kv = self._replay(self.draft.params, self.kv, self._batch([], size))
        R = c.max_num_seqs
        zeros = np.zeros(R, np.int32)
        self.kv, _ = self._propose(self.draft.params, self.kv, zeros, zeros,
                                   np.zeros((R, self._width), np.int32), np.int32(0))

    def verify[T: _Token](self, plan: SchedulerOutput, rows: Mapping[str, Sequence[T]],
                          tracked: Mapping[str, TrackedRequest]
                          ) -> tuple[dict[str, list[T]], Any]:
        """Replay the step's batch on the draft model, then verify as the base does."""
        order = list(plan.num_scheduled_tokens)
        if order:
            chunks = [RequestChunk(token_ids=_known_inputs(plan, r, tracked.get(r)),
                                   start=plan.num_computed_tokens[r],
                                   block_table=plan.block_tables[r]) for r in order]
            total = sum(len(ch.token_ids) for ch in chunks)
            size = pick_bucket(self.runner.token_buckets, total)
            self.kv = self._replay(self.draft.params, self.kv, self._batch(chunks, size))
        self._tables = plan.block_tables
        return super().verify(plan, rows, tracked)

    def propose(self, tracked: Mapping[str, TrackedRequest],
                sampled: Mapping[str, Sequence[_Token]], stopped: Mapping[str, str],
                in_flight: SchedulerOutput | None = None) -> dict[str, list[int]]:
        """Drafts of every request that may get them, from one batched device call."""
        c = self.runner.config
        rows, room = [], []
        for rid, t, tokens, lag, n in self.to_draft(tracked, sampled, stopped, in_flight):
            position = len(t.prompt_token_ids) + len(t.token_ids) + len(tokens) - 1
            rows.append((rid, tokens[-1].token_id, position))
            room.append((lag, n))
        if not rows:
            return {}
        R = c.max_num_seqs
        tokens, positions = np.zeros(R, np.int32), np.zeros(R, np.int32)
        tables = np.zeros((R, self._width), np.int32)
        for i, (rid, token, position) in enumerate(rows):
            own = self._tables[rid]
            tokens[i], positions[i] = token, position
            tables[i, :len(own)] = own
            first = c.num_blocks + i * self.scratch  # this row's scratch pages
            tables[i, len(own):len(own) + self.scratch] = np.arange(first, first + self.scratch)
        self.kv, drafts = self._propose(self.draft.params, self.kv, tokens, positions, tables,
                                        np.int32(len(rows)))
        drafts = np.asarray(drafts)
        return {rid: drafts[i, lag:lag + n].tolist() for i, ((rid, _, _), (lag, n)) in
                enumerate(zip(rows, room, strict=True))}

    def _batch(self, chunks: Sequence[RequestChunk], num_tokens: int) -> ModelBatch:
        c = self.runner.config
        return pack_batch(chunks, num_tokens=num_tokens, max_seqs=c.max_num_seqs,
                          max_blocks=self._width, block_size=c.block_size)


def _known_inputs(plan: SchedulerOutput, rid: str, t: TrackedRequest | None
                  ) -> tuple[int, ...]:
    """The request's input tokens in `plan` with each placeholder (async scheduling: the token
    of the step before) read from its history, where it is by the time `plan` is collected
    (0 for a request that left meanwhile, `t` None: its KV is never read)."""
    ids = plan.input_token_ids[rid]
    if PLACEHOLDER_TOKEN_ID not in ids:
        return ids
    if t is None:
        return tuple(0 if x == PLACEHOLDER_TOKEN_ID else x for x in ids)
    start, history = plan.num_computed_tokens[rid], (*t.prompt_token_ids, *t.token_ids)
    return tuple(history[start + j] if x == PLACEHOLDER_TOKEN_ID else x
                 for j, x in enumerate(ids))
