"""A collected step's tokens into the engine: the stages of docs/DESIGN.md "One engine step"
after *sample*, which both loops (`engine/loops.py`) run on the step they finish.

`take_prompt_logprobs` records the prompt logprobs the step computed, `verify` keeps each
request's accepted drafts (speculative decoding), and `update` does the rest in order: the
grammars accept the tokens, *detokenize* (a stop string must reach the scheduler with its
token), the next drafts, the scheduler's *update* with the KV worker's transfers, then each
request's *outputs* and the step's statistics (*record*).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from jaxengine.engine.outputs import RequestOutput
from jaxengine.engine.prompt_logprob_outputs import record_prompt_logprobs
from jaxengine.engine.stats import IterationStats
from jaxengine.runner.in_flight import InFlight, SampledToken
from jaxengine.spec.metrics import SpecDecodingStats
from scheduler import (
    RequestDelta,
    RequestOutputKind,
    SchedulerOutput,
    SchedulerState,
    update_from_output,
)

if TYPE_CHECKING:  # the loops pass the engine whose step they finish
    from jaxengine.engine.llm_engine import LLMEngine


def take_prompt_logprobs(e: LLMEngine, step: InFlight | None,
                         dropped: set[str] | None = None) -> None:
    """Record the prompt logprobs a collected step computed (before its outputs; not those of
    `dropped`, requests that left while it was in flight)."""
    if step is not None:
        record_prompt_logprobs(e._tracked, e.runner.collect_prompt_logprobs(step),
                               skip=dropped or ())


def verify(e: LLMEngine, plan: SchedulerOutput, rows: dict[str, list[SampledToken]],
           dropped: set[str] | None = None
           ) -> tuple[dict[str, list[SampledToken]], SpecDecodingStats | None]:
    """Each request's tokens of a collected step: with speculation, its accepted drafts'
    (`Speculator.verify`, shown none of `dropped`: their ids may be new requests'), and the
    step's draft statistics."""
    if e.speculator is None:
        return rows, None
    tracked = e._tracked
    if dropped:
        tracked = {r: t for r, t in tracked.items() if r not in dropped}
    return e.speculator.verify(plan, rows, tracked)


def update(e: LLMEngine, state: SchedulerState, before: SchedulerState, plan: SchedulerOutput,
           sampled: dict[str, list[SampledToken]], *,
           spec_decoding: SpecDecodingStats | None = None,
           in_flight: SchedulerOutput | None = None) -> list[RequestOutput]:
    """Take one step's tokens (of `plan`; per request one, or its accepted drafts' too; none of
    requests that left while it was in flight) into `state`, with the next step's drafts
    (after `in_flight`, the plan dispatched since, under async scheduling); its outputs."""
    e.grammars.accept_sampled(e._tracked, sampled)
    stopped = _detokenize(e, sampled)  # before update: a stop string ends the request there
    drafts = (None if e.speculator is None
              else e.speculator.propose(e._tracked, sampled, stopped, in_flight))
    e.state, deltas = update_from_output(
        state, plan, {rid: [t.token_id for t in ts] for rid, ts in sampled.items()}, drafts,
        stopped=stopped, kv_connector=e.kv_worker.connector,
        kv_connector_output=e.kv_worker.take_output())
    now = e.clock()
    # The step's statistics are made only for their readers: the stat loggers and a KV
    # worker that records into them (offloading moves its transfers there).
    stats = None
    if e.stat_loggers or e.kv_worker.records_stats:
        stats = IterationStats.between(before.counters, e.state.counters, timestamp=now)
        stats.spec_decoding = spec_decoding
    outputs = []
    for d in deltas:
        out = _apply(e, d, (sampled.get(d.request_id) or [None])[0], now, stats)
        if out is not None:
            outputs.append(out)
    if stats is not None:
        e._record(stats)
    return outputs


def _detokenize(e: LLMEngine, sampled: Mapping[str, list[SampledToken]]) -> dict[str, str]:
    """Decode each sampled token in order; request id -> the stop string one completed (the
    tokens after it are cut from its list: never emitted)."""
    stopped: dict[str, str] = {}
    if e.tokenizer is None:  # no detokenizers: nothing to decode, no stop strings
        return stopped
    for rid, tokens in sampled.items():
        for i, token in enumerate(tokens):
            hit = e._tracked[rid].detokenize(token.token_id)
            if hit is not None:
                stopped[rid] = hit
                del tokens[i + 1:]
                break
    return stopped


def _apply(e: LLMEngine, delta: RequestDelta, sampled: SampledToken | None, now: float,
           stats: IterationStats | None) -> RequestOutput | None:
    """Take one request's delta (of the step that ended `now`) into its engine state and the
    step's statistics (None: nobody reads them); its output (None: it runs on, and its client
    asked only for the final one)."""
    tracked = e._tracked[delta.request_id]
    if stats is not None:
        stats.observe_tokens(len(delta.new_token_ids),
                             prompt_len=len(tracked.prompt_token_ids), before=tracked)
    tracked.apply(delta, sampled, now)
    if tracked.finish_reason is not None:
        del e._tracked[delta.request_id]
        e._loop.drop((delta.request_id,))
        if stats is not None:
            stats.finished_requests.append(tracked.finished_stats())
        return e._with_kv_transfer_params(tracked, tracked.output())
    if tracked.params.output_kind is RequestOutputKind.FINAL_ONLY:
        return None
    return tracked.output()
