"""Verifying draft tokens in one target step: which rows to sample, and which drafts to keep.

A request with drafts d_0..d_{k-1} is scheduled with its newest token and the drafts (the
scheduler's `scheduled_spec_decode_tokens`); the model's hidden rows at those 1 + k positions
give the target's distributions p_0..p_k, p_j conditioned on the context plus d_0..d_{j-1}.
The runner gathers the rows (`gather_indices`: a fixed i32[R * (1 + K)], K =
`num_speculative_tokens`) and samples each like an ordinary row (`sampler_rows`): x_j is drawn
from p_j with the request's usual key of (seed, output position + j). `num_accepted` keeps x_0 and,
while x_j == d_j, x_{j+1}: the emitted tokens are x_0..x_a, a the accepted drafts.

Why that is exact. Our drafts are deterministic (prompt lookup, or a draft model's greedy
tokens), a one-hot proposal q = e_d. Rejection sampling (vLLM's `RejectionSampler`) accepts d
with probability min(1, p(d)/q(d)) = p(d), and on rejection draws from the residual (p - q)+
normalised, which is p with d removed.
Drawing x ~ p and accepting iff x == d does the same: P(accept) = p(d), and given x != d, x is
distributed as p without d. So every emitted token has the target's distribution, greedy
decoding is exact (x_j is the argmax), and since x_j uses the key the non-speculative loop would
use for that output position, a seeded request emits the very tokens it emits without drafts.

Requests whose sampling depends on state the rows do not replay get no drafts (`draftable`):
penalties, logit_bias and allowed_token_ids (the runner's per-request tables count every row's
token), bad words, grammars, logprobs (one logprobs entry per step) and min_tokens not reached
yet (its bans depend on the position). They sample one row in the same batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from jaxengine.sampling.request_tables import uses_table
from jaxengine.sampling.rows import SamplingRow
from scheduler import SamplingParams


def draftable(params: SamplingParams, *, num_output_tokens: int,
              bad_words_token_ids: Sequence[Sequence[int]] = (), has_grammar: bool = False
              ) -> bool:
    """Whether a request may get drafts for its next step (see the module docstring).

    Args:
      params: its sampling parameters.
      num_output_tokens: outputs it will have when the drafts are verified (the position of
        the first token then drawn).
      bad_words_token_ids: its tokenized bad words.
      has_grammar: it follows a structured-output grammar.
    """
    return (not uses_table(params, bad_words_token_ids) and not bad_words_token_ids
            and not has_grammar and params.logprobs is None
            and num_output_tokens >= params.min_tokens)


def gather_indices(query_start_loc: np.ndarray, num_drafts: Sequence[int], *, num_seqs: int,
                   width: int) -> np.ndarray:
    """Token rows of the hidden states to keep: for request i (batch order) and j < width,
    row i * width + j is its token (num_drafts[i] - j) before its last scheduled one, for
    j <= num_drafts[i] (the last row repeats after). Shapes: query_start_loc i32[R+1] ->
    i32[R * width], R = num_seqs."""
    last = np.maximum(query_start_loc[1:num_seqs + 1].astype(np.int64) - 1, 0)  # i64[R]
    d = np.zeros(num_seqs, np.int64)
    d[: len(num_drafts)] = num_drafts
    j = np.arange(width)[None, :]
    rows = last[:, None] - d[:, None] + np.minimum(j, d[:, None])  # i64[R, width]
    return rows.reshape(-1).astype(np.int32)


def sampler_rows(order: Sequence[str], sampling_ids: Sequence[str],
                 rows: Mapping[str, SamplingRow], drafts: Mapping[str, Sequence[int]], *,
                 width: int) -> tuple[list[str], list[SamplingRow], list[int]]:
    """The sampler's rows: one per request, and one more per scheduled draft.

    Args:
      order: the batch's requests, in batch order (hidden rows `i * width ..`).
      sampling_ids: the requests that sample, in the plan's order.
      rows: each one's parameters, seed and position of its first token drawn.
      drafts: the scheduled drafts of some of them.
      width: 1 + K, hidden rows per request.
    Returns:
      (the request id of each sampler row, its `SamplingRow` at output position
      `position + j`, its index into the gathered hidden rows).
    Raises:
      ValueError: drafts for a request that is not `draftable`.
    """
    where = {r: i for i, r in enumerate(order)}
    ids, batch_rows, index = [], [], []
    for rid in sampling_ids:
        row, n = rows[rid], len(drafts.get(rid, ()))
        if n and not draftable(row.params, num_output_tokens=row.position,
                               bad_words_token_ids=row.bad_words_token_ids,
                               has_grammar=row.grammar is not None):
            raise ValueError(f"request {rid!r} has drafts but samples with per-step state "
                             f"(penalties, biases, bad words, a grammar, logprobs or "
                             f"min_tokens): it must get none")
        for j in range(n + 1):
            ids.append(rid)
            batch_rows.append(row if j == 0 else replace(row, position=row.position + j))
            index.append(where[rid] * width + j)
    return ids, batch_rows, index


def num_accepted(drafts: Sequence[int], token_ids: Sequence[int]) -> int:
    """How many drafts the sampled rows accept: the a with x_j == d_j for every j < a, and
    x_a != d_a or a == k. The request emits x_0..x_a (a + 1 tokens).

    Args:
      drafts: d_0..d_{k-1}, the drafts verified.
      token_ids: x_0..x_k, the k + 1 rows' sampled tokens.
    """
    if len(token_ids) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} sampled rows, got "
                         f"{len(token_ids)}")
    a = 0
    while a < len(drafts) and token_ids[a] == drafts[a]:
        a += 1
    return a
