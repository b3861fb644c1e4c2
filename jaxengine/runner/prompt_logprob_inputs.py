"""The runner's side of prompt logprobs: which positions of a step want them, and what came back.

The runner learns the requests that asked (`SamplingParams.prompt_logprobs`) and their prompts
from each plan's new requests, as vLLM's model runner keeps its per-request state, and forgets
them when the plan reports them finished. For a packed batch, `targets` gives every position
the prompt token it predicts (the host knows the prompt, so a chunk's last position gets the
next chunk's first token) and says where each request's positions sit in the batch; the device
computes them (`jaxengine/sampling/prompt_logprobs.py`), and `read` cuts the host copy of its
result into per-request chunks. A request recomputing its prompt after a preemption gets its
positions again; the engine keeps the first copy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from jaxengine.sampling.prompt_logprobs import PromptLogprobs
from scheduler import SchedulerOutput


@dataclass(frozen=True, slots=True)
class PromptSpan:
    """One request's prompt-logprob positions in a batch: positions `start` .. `start + count
    - 1` of its prompt, at batch rows `offset` .. `offset + count - 1`."""

    start: int  # its first position p (which predicts prompt token p + 1)
    offset: int  # the batch row of that position
    count: int


@dataclass(frozen=True, slots=True)
class PromptLogprobChunk:
    """The prompt logprobs one step computed for one request (host arrays, n positions)."""

    start: int  # position p of the first row; row i is prompt token start + i + 1's entry
    token_ids: np.ndarray  # i32[n]  the prompt tokens predicted (the targets)
    logprobs: np.ndarray  # f32[n]
    ranks: np.ndarray  # i32[n]
    top_token_ids: np.ndarray  # i32[n, k]  best first (k = the engine's max_logprobs)
    top_logprobs: np.ndarray  # f32[n, k]


class PromptLogprobInputs:
    """The prompts of the live requests that want prompt logprobs, and each step's targets."""

    def __init__(self) -> None:
        self._prompts: dict[str, tuple[int, ...]] = {}

    def update(self, out: SchedulerOutput) -> None:
        """Forget the requests `out` reports finished, then learn its new ones that ask (in
        this order: a finished id may be reused by a new request)."""
        for rid in out.finished_req_ids:
            self._prompts.pop(rid, None)
        for new in out.scheduled_new_reqs:
            if new.sampling_params.prompt_logprobs is not None:
                self._prompts[new.req_id] = tuple(new.prompt_token_ids)

    def targets(self, out: SchedulerOutput, order: Sequence[str], query_start_loc: np.ndarray,
                num_tokens: int) -> tuple[np.ndarray, dict[str, PromptSpan]]:
        """Each batch position's target id (i32[num_tokens], -1: none) and each asking
        request's span; `order` is the batch's request order, `query_start_loc` i32[R+1]."""
        targets = np.full(num_tokens, -1, np.int32)
        spans: dict[str, PromptSpan] = {}
        if not self._prompts:
            return targets, spans
        for i, rid in enumerate(order):
            prompt = self._prompts.get(rid)
            if prompt is None:
                continue
            start = out.num_computed_tokens[rid]
            stop = min(start + out.num_scheduled_tokens[rid], len(prompt) - 1)
            if stop <= start:  # decoding, or the prompt's last position (it samples)
                continue
            offset = int(query_start_loc[i])
            targets[offset: offset + stop - start] = prompt[start + 1: stop + 1]
            spans[rid] = PromptSpan(start=start, offset=offset, count=stop - start)
        return targets, spans

    @staticmethod
    def read(result: PromptLogprobs, targets: np.ndarray,
             spans: Mapping[str, PromptSpan]) -> dict[str, PromptLogprobChunk]:
        """Cut a step's result (host arrays) into each request's chunk."""
        chunks = {}
        for rid, s in spans.items():
            rows = slice(s.offset, s.offset + s.count)
            chunks[rid] = PromptLogprobChunk(
                start=s.start, token_ids=targets[rows], logprobs=result.logprobs[rows],
                ranks=result.ranks[rows], top_token_ids=result.top_token_ids[rows],
                top_logprobs=result.top_logprobs[rows])
        return chunks
