"""A step's model batch on the host: the plan packed into a padded `ModelBatch` (token count
bucketed, request arrays at the fixed size `max_num_seqs`) with the placeholders it fills from
the step before, and the same batch in the abstract, as precompiling takes it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import jax
import numpy as np

from jaxengine.model.batch import ModelBatch, RequestChunk, pack_batch
from jaxengine.runner.bucket_programs import spec
from jaxengine.runner.buckets import pick_bucket
from jaxengine.runner.config import RunnerConfig
from jaxengine.runner.in_flight import InFlight
from jaxengine.runner.lora_inputs import token_slots
from jaxengine.runner.verify import gather_indices
from scheduler import PLACEHOLDER_TOKEN_ID, SchedulerOutput


def pack_step(out: SchedulerOutput, order: Sequence[str], prev: InFlight | None,
              lora_slots: Mapping[str, int], *, config: RunnerConfig,
              token_buckets: Sequence[int], lora: bool) -> tuple[ModelBatch, np.ndarray]:
    """The padded batch (with LoRA each token's adapter slot), and for each of its tokens
    the row of `prev.tokens` a placeholder takes (-1: not a placeholder).

    Args:
      out: the plan of one step; `order`: its scheduled requests, in batch order.
      prev: the step in flight before it (its sampled tokens fill the placeholders).
      lora_slots: the slot of each request's adapter (a request not in it: the base model).
      config: the runner's sizes; `token_buckets`: its token counts; `lora`: it has slots.
    Returns:
      (ModelBatch of T tokens, fill i32[T]).
    Raises:
      ValueError: a placeholder for a request that `prev` does not sample, or adapter slots
        given to a runner without LoRA.
    """
    c = config
    groups = out.group_block_tables if c.num_kv_cache_groups > 1 else None
    chunks = [
        RequestChunk(token_ids=out.input_token_ids[r], start=out.num_computed_tokens[r],
                     block_table=out.block_tables[r],
                     group_block_tables=None if groups is None else [g[r] for g in groups])
        for r in order
    ]
    total = sum(len(ch.token_ids) for ch in chunks)
    num_tokens = pick_bucket(token_buckets, total)
    batch = pack_batch(chunks, num_tokens=num_tokens, max_seqs=c.max_num_seqs,
                       max_blocks=c.max_blocks_per_seq, block_size=c.block_size,
                       num_groups=c.num_kv_cache_groups)
    if c.num_speculative_tokens:  # also the rows of each request's drafts
        drafts = out.scheduled_spec_decode_tokens
        batch = replace(batch, logits_indices=gather_indices(
            batch.query_start_loc, [len(drafts.get(r, ())) for r in order],
            num_seqs=c.max_num_seqs, width=1 + c.num_speculative_tokens))
    if lora:
        batch = replace(batch, lora_slots=token_slots(
            batch.query_start_loc, [lora_slots.get(r, 0) for r in order], num_tokens))
    elif lora_slots:
        raise ValueError("requests with LoRA adapters, but this runner has no adapter "
                         "slots (enable_lora)")
    fill = np.full(num_tokens, -1, np.int32)
    holes = np.flatnonzero(batch.input_ids[:total] == PLACEHOLDER_TOKEN_ID)
    if len(holes):
        sampled_by_prev = first_rows(prev)
        starts = batch.query_start_loc[: len(order)]
        for hole in holes:
            rid = order[int(np.searchsorted(starts, hole, side="right")) - 1]
            if rid not in sampled_by_prev:
                raise ValueError(f"request {rid!r} has a placeholder input but the step "
                                 f"before does not sample it")
            fill[hole] = sampled_by_prev[rid]
    return batch, fill


def batch_spec(config: RunnerConfig, num_tokens: int, *, lora: bool) -> ModelBatch:
    """The batch of `num_tokens` tokens as a step's program takes it (abstract leaves)."""
    c = config
    batch = pack_batch([], num_tokens=num_tokens, max_seqs=c.max_num_seqs,
                       max_blocks=c.max_blocks_per_seq, block_size=c.block_size,
                       num_groups=c.num_kv_cache_groups)
    if c.num_speculative_tokens:  # the step keeps 1 + K hidden rows per request
        batch = replace(batch, logits_indices=np.zeros(c.max_num_rows, np.int32))
    if lora:
        batch = replace(batch, lora_slots=np.zeros(num_tokens, np.int32))
    return jax.tree.map(spec, batch)


def first_rows(prev: InFlight | None) -> dict[str, int]:
    """Each request `prev` samples -> its first row in `prev.tokens` (its token; the rows of
    its drafts follow it)."""
    rows: dict[str, int] = {}
    for i, rid in enumerate(() if prev is None else prev.row_ids):
        rows.setdefault(rid, i)
    return rows
