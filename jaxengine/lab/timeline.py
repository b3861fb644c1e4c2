"""`StepRecord`: what one scheduler step did, as the timeline plot draws it.

A record is built by a pure function from the scheduler's state before a `schedule()` call, the
state it returned and its plan (`step_record`), so anything that drives the pure scheduler can
produce records: the simulator (which passes its simulated clock) and a real `LLMEngine` run
(`EngineTimeline`, which passes the wall clock). The records are plain numbers; `plots.timeline`
draws a list of them.

Which tokens are decode tokens? The scheduler has no phases (docs/SCHEDULING.md §1), so the
split is made here, per request, from its counters: a request whose one scheduled token (plus
any draft tokens) is an output position — `num_computed_tokens >= num_prompt_tokens` and exactly
one known token left to compute — is decoding; every other scheduled token (prompt chunks,
and the recomputation of a preempted request's prompt and outputs) is a prefill token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler import SchedulerOutput, SchedulerState, schedule

if TYPE_CHECKING:  # the engine pulls in jax; step_record needs only the scheduler
    from jaxengine.engine.llm_engine import LLMEngine
    from jaxengine.engine.outputs import RequestOutput


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """One `schedule()` call of a run, after its allocation and preemptions."""

    step: int  # index of the schedule() call in the state's lineage, from 0
    time_s: float  # when the step was scheduled, seconds since the run started
    decode_tokens: int  # tokens of decoding requests: last step's sampled token (+ drafts)
    prefill_tokens: int  # prompt-chunk tokens and the recomputation of preempted requests
    kv_cache_usage: float  # used / usable KV blocks once the step has allocated, in [0, 1]
    num_preempted: int  # requests this step preempted
    prefix_hit_tokens: int  # tokens found in the prefix cache by this step's admissions
    num_running: int  # requests in `running` after the step was scheduled
    num_waiting: int  # requests in `waiting` after the step was scheduled

    @property
    def num_scheduled_tokens(self) -> int:
        """All tokens of the step (the plan's `total_num_scheduled_tokens`)."""
        return self.decode_tokens + self.prefill_tokens


def step_record(before: SchedulerState, after: SchedulerState, plan: SchedulerOutput, *,
                time_s: float) -> StepRecord:
    """The record of one step: `after, plan = schedule(before)`.

    Args:
      before: the state `schedule()` was given.
      after: the state it returned (computed counters advanced, blocks allocated).
      plan: the plan it returned.
      time_s: when the step was scheduled, seconds since the run started (the caller's clock:
        simulated or wall).
    Returns:
      The step's `StepRecord`.
    Raises:
      ValueError: `after` and `plan` are not what `schedule(before)` returned.
    """
    if after.step != before.step + 1:
        raise ValueError(f"after.step must be before.step + 1 (the result of schedule(before)); "
                         f"got before.step={before.step}, after.step={after.step}")
    # `after.requests[rid]` builds a whole Request with its outputs (about 7 us); the simulator
    # asks this of every running request at every step, so only the prompt length is read:
    # with 256 decoding requests, 0.1 ms a step instead of 1.8 ms.
    decode = 0
    spec = plan.scheduled_spec_decode_tokens
    for rid, n in plan.num_scheduled_tokens.items():
        # Only a one-token request (drafts aside) can be a decode; only those need a lookup.
        if n - len(spec.get(rid, ())) == 1 and (
                plan.num_computed_tokens[rid] >= after.num_prompt_tokens(rid)):
            decode += n
    stats, old = after.stats, before.counters
    hits = (stats.prefix_cache_hits - old.prefix_cache_hits
            + stats.preempted_prefix_cache_hits - old.preempted_prefix_cache_hits)
    return StepRecord(
        step=before.step, time_s=time_s, decode_tokens=decode,
        prefill_tokens=plan.total_num_scheduled_tokens - decode,
        kv_cache_usage=stats.kv_cache_usage, num_preempted=len(plan.preempted_req_ids),
        prefix_hit_tokens=hits, num_running=stats.num_running, num_waiting=stats.num_waiting)


class EngineTimeline:
    """Collects a `StepRecord` per `LLMEngine.step()` without changing the engine.

    The scheduler is pure and deterministic, so scheduling the engine's snapshot gives exactly
    the plan and state its next `step()` computes; the cost is one extra `schedule()` per step
    on the host. Use `timeline.step()` in place of `engine.step()`:

        timeline = EngineTimeline(engine)
        while engine.has_unfinished_requests():
            outputs = timeline.step()
        plots.timeline(timeline.records)
    """

    def __init__(self, engine: LLMEngine, *, clock: Callable[[], float] = time.perf_counter):
        """Args:
          engine: the engine to step.
          clock: seconds, monotonic; `time_s` of the records counts from construction.
        """
        self.engine = engine
        self._clock = clock
        self._start = clock()
        self.records: list[StepRecord] = []  # one per step() call, in order

    def step(self) -> list[RequestOutput]:
        """Record the engine's next step, then run it; returns what `engine.step()` returns."""
        before = self.engine.snapshot()
        now = self._clock() - self._start
        after, plan = schedule(before)
        self.records.append(step_record(before, after, plan, time_s=now))
        return self.engine.step()
