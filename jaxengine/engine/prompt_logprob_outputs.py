"""The engine's side of prompt logprobs: the runner's per-step chunks into vLLM's list.

`RequestOutput.prompt_logprobs` has one entry per prompt token: `None` for the first (nothing
predicts it), then `{token id: Logprob}` holding the prompt token (its logprob and rank) and the
request's top `prompt_logprobs` tokens, the shape vLLM returns. Each step's chunk covers the
positions it computed (`jaxengine/runner/prompt_logprob_inputs.py`); a request that
recomputes its prompt after a preemption gets positions it has already, and keeps the first.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from jaxengine.engine.outputs import Logprob, PromptLogprobs
from jaxengine.engine.request_state import TrackedRequest
from jaxengine.runner.prompt_logprob_inputs import PromptLogprobChunk


def record_prompt_logprobs(tracked: Mapping[str, TrackedRequest],
                           chunks: Mapping[str, PromptLogprobChunk], *,
                           skip: Collection[str] = ()) -> None:
    """Append each live request's new positions to its `prompt_logprobs`.

    Args:
      tracked: the engine's live requests.
      chunks: one step's results by request id.
      skip: ids whose results are stale (they left while the step was in flight; the id may
        now name a new request).
    """
    for rid, chunk in chunks.items():
        t = tracked.get(rid)
        if t is None or rid in skip or t.prompt_logprobs is None:
            continue
        decode = _decoder(t)
        append_chunk(t.prompt_logprobs, chunk, t.params.prompt_logprobs or 0, decode)


def append_chunk(entries: PromptLogprobs, chunk: PromptLogprobChunk, num_top: int,
                 decode: Callable[[int], str | None]) -> None:
    """Append the entries of `chunk` that `entries` does not hold yet (entry p + 1 is position
    p's; `entries` starts as `[None]`)."""
    for i in range(len(chunk.logprobs)):
        index = chunk.start + i + 1
        if index < len(entries):
            continue  # recomputed after a preemption: the first copy stays
        assert index == len(entries), f"prompt logprobs skip from {len(entries)} to {index}"
        token = int(chunk.token_ids[i])
        entry = {token: Logprob(float(chunk.logprobs[i]), int(chunk.ranks[i]), decode(token))}
        for rank, (tid, lp) in enumerate(zip(chunk.top_token_ids[i, :num_top].tolist(),
                                             chunk.top_logprobs[i, :num_top].tolist(),
                                             strict=True), start=1):
            entry.setdefault(tid, Logprob(lp, rank, decode(tid)))
        entries.append(entry)


def _decoder(t: TrackedRequest) -> Callable[[int], str | None]:
    """Each token's text, decoded once per chunk (the top ids repeat from position to
    position: a 4096-token prompt with 20 top logprobs is 86 000 entries)."""
    tok = t.detokenizer.tokenizer if t.detokenizer is not None else None
    texts: dict[int, str | None] = {}

    def decode(tid: int) -> str | None:
        if tid not in texts:
            texts[tid] = None if tok is None else tok.decode([tid], skip_special_tokens=False)
        return texts[tid]

    return decode
