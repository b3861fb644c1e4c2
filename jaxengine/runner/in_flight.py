"""What a step hands back: a dispatched step still on the device (`Forward`, then `InFlight`)
and, once collected, each request's `SampledToken`s."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import jax
import numpy as np

from jaxengine.runner.compiles import Compiles
from jaxengine.runner.prompt_logprob_inputs import PromptSpan
from jaxengine.sampling.prompt_logprobs import PromptLogprobs
from jaxengine.sampling.rows import SamplingRow
from jaxengine.sampling.sampler import SamplerOutput
from scheduler import SchedulerOutput

# A step's prompt logprobs on the device, its targets i32[T] and each asking request's span.
PromptInFlight = tuple[PromptLogprobs, np.ndarray, Mapping[str, PromptSpan]]


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One request's token of this step, with its raw logprobs when asked for."""

    token_id: int
    logprob: float | None  # of the sampled token; None when the request asked no logprobs
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first
    rank: int | None = None  # of the sampled token (1 = the most likely); None as logprob


@dataclass(frozen=True, slots=True)
class InFlight:
    """A dispatched step: its plan and its sampler's results, still on the device."""

    plan: SchedulerOutput
    rows: Mapping[str, SamplingRow]  # of plan.sampling_req_ids
    result: SamplerOutput | None  # device arrays; None when nobody samples
    tokens: jax.Array  # i32[R * (1 + K)]  sampled tokens in `row_ids` order, zeros after
    row_ids: tuple[str, ...]  # the request of each sampler row: sampling_req_ids, each
    # followed by one row per draft it verifies (jaxengine/runner/verify.py)
    started: float  # perf_counter() at dispatch
    num_tokens: int  # the token bucket
    total: int  # scheduled (real) tokens
    prompt_logprobs: PromptInFlight | None = None  # None: no position asked for them


@dataclass(frozen=True, slots=True)
class Forward:
    """A dispatched model step whose sampler is not dispatched yet (`Runner.dispatch_forward`)."""

    plan: SchedulerOutput
    order: list[str]  # the plan's requests, in batch order
    hidden: jax.Array  # [R * (1 + K), D] hidden rows, on the device
    prev: InFlight | None  # the step its placeholders read
    started: float  # perf_counter() at dispatch
    compiles_before: Compiles  # this thread's compilations by name at dispatch
    num_tokens: int  # the token bucket
    total: int  # scheduled (real) tokens
    prompt_logprobs: PromptInFlight | None = None  # None: no position asked for them


def sampled_tokens(result: SamplerOutput, row_ids: Sequence[str],
                   rows: Mapping[str, SamplingRow]) -> dict[str, list[SampledToken]]:
    """A collected step's tokens, per sampling request in row order (its token, then one per
    draft it verifies), with the logprobs each asked for.

    Args:
      result: the sampler's results on the host (numpy leaves).
      row_ids: the request of each sampler row (`InFlight.row_ids`).
      rows: each request's sampling row (its `params.logprobs`).
    """
    out: dict[str, list[SampledToken]] = {}
    for i, r in enumerate(row_ids):
        n = rows[r].params.logprobs
        top = tuple(zip(result.top_token_ids[i, :n].tolist(),
                        result.top_logprobs[i, :n].tolist(), strict=True)) if n else ()
        lp, rank = (None, None) if n is None else (float(result.logprobs[i]),
                                                   int(result.ranks[i]))
        out.setdefault(r, []).append(SampledToken(int(result.token_ids[i]), lp, top, rank))
    return out
