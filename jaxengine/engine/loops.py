"""The engine's two step loops; `LLMEngine` picks one when it is built (as vLLM's `EngineCore`
picks `step` or `step_with_batch_queue`).

Each loop's `step` takes the plan the engine's call just scheduled (`state`: the scheduler
state after it, `before`: the one before) and returns the outputs of the plan the call
finished; each dispatches with `sampling_rows` and finishes a collected step with the stages
of `engine/step_outputs.py`, which docs/DESIGN.md "One engine step" lists.

- `SyncLoop` finishes each plan in the call that made it: dispatch, collect, update.
- `AsyncLoop` (`async_scheduling`, docs/DESIGN.md "Async scheduling") dispatches a plan and
  finishes it in the next call, behind the next plan's dispatch, and holds all that needs: the
  step in flight, the plan dispatched last and the ids whose tokens in it went stale. A step
  in flight that verifies drafts is finished before the next plan is made instead
  (`finish_verifying`), so its requests are planned again at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from jaxengine.engine import step_outputs
from jaxengine.engine.outputs import RequestOutput
from jaxengine.engine.request_state import sampling_rows
from jaxengine.engine.stats import IterationStats
from jaxengine.runner.in_flight import InFlight
from scheduler import SchedulerOutput, SchedulerState

if TYPE_CHECKING:  # the engine builds its loop and passes itself
    from jaxengine.engine.llm_engine import LLMEngine


class SyncLoop:
    """One call, one plan, run to the end; nothing stays in flight between calls."""

    in_flight: InFlight | None = None  # never set: every step is collected in its own call

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def step(self, state: SchedulerState, before: SchedulerState,
             plan: SchedulerOutput) -> list[RequestOutput]:
        """Pack, run and sample `plan`, wait for its tokens, verify and update; its outputs."""
        e = self.engine
        step = e.runner.dispatch(plan, sampling_rows(plan, e._tracked, e.eos_token_id),
                                 lora_slots=e.lora_slots(plan))
        sampled = {} if step is None else e.runner.collect_rows(step)
        step_outputs.take_prompt_logprobs(e, step)
        sampled, spec_stats = step_outputs.verify(e, plan, sampled)
        return step_outputs.update(e, state, before, plan, sampled, spec_decoding=spec_stats)

    def finish_verifying(self) -> list[RequestOutput]:
        """Nothing is in flight between calls: nothing to finish."""
        return []

    def drop(self, request_ids: Iterable[str]) -> None:
        """Requests that left between calls: no step holds tokens of theirs."""


class AsyncLoop:
    """Each call dispatches its plan behind the step in flight, then finishes that step: the
    outputs are the synchronous loop's, one call later (the first call returns none)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.in_flight: InFlight | None = None  # the step dispatched last, not collected
        self.plan: SchedulerOutput | None = None  # the plan dispatched last (`_dropped`'s)
        self._dropped: set[str] = set()  # ids whose tokens in `in_flight` are stale

    def step(self, state: SchedulerState, before: SchedulerState,
             plan: SchedulerOutput) -> list[RequestOutput]:
        """Dispatch `plan`, then collect and update the step dispatched by the call before
        (a call that schedules nothing still collects)."""
        e = self.engine
        prev, dropped = self.in_flight, self._dropped
        self._dropped, self.plan = set(), plan
        if prev is not None and e.grammars.samples_a_grammar(e._tracked, plan.sampling_req_ids):
            return self._step_sampling_a_grammar(state, before, plan, prev, dropped)
        self.in_flight = e.runner.dispatch(plan, sampling_rows(plan, e._tracked, e.eos_token_id),
                                           prev, lora_slots=e.lora_slots(plan))
        e.state = state
        if prev is None and self.in_flight is None:  # an empty plan, nothing in flight: done
            return step_outputs.update(e, state, before, plan, {})
        if prev is None:  # nothing to collect yet; the step's statistics are its scheduling
            e._record(IterationStats.between(before.counters, state.counters,
                                             timestamp=e.clock()))
            return []
        return self._finish(state, before, prev, dropped)

    def finish_verifying(self) -> list[RequestOutput]:
        """If the step in flight verifies drafts, collect and update it now, before the next
        plan is made; its outputs (none otherwise).

        Its requests get 1 to k + 1 tokens there, known only once it is collected; a plan made
        before would have them sit its step out (docs/SCHEDULING.md §4.1). Made after, it
        plans them at once, and with drafts that follow their real tokens (docs/DESIGN.md
        "Speculative decoding"). The device waits for the host's update and the next plan.
        """
        prev = self.in_flight
        if prev is None or not prev.plan.scheduled_spec_decode_tokens:
            return []
        e, dropped = self.engine, self._dropped
        self.in_flight, self.plan, self._dropped = None, None, set()
        return self._finish(e.state, e.state, prev, dropped)

    def _step_sampling_a_grammar(self, state: SchedulerState, before: SchedulerState,
                                 plan: SchedulerOutput, prev: InFlight,
                                 dropped: set[str]) -> list[RequestOutput]:
        """The bitmasks of `plan` need the tokens of the step in flight (vLLM's order):
        dispatch its forward, finish that step while it runs, then dispatch its sampler (with
        the rows of requests that finish meanwhile)."""
        e = self.engine
        tracked = {r: e._tracked[r] for r in plan.sampling_req_ids}
        forward = e.runner.dispatch_forward(plan, prev, lora_slots=e.lora_slots(plan))
        e.state = state
        outputs = self._finish(state, before, prev, dropped)
        assert forward is not None  # the plan samples a request
        self.in_flight = e.runner.dispatch_sample(forward,
                                                  sampling_rows(plan, tracked, e.eos_token_id))
        return outputs

    def _finish(self, state: SchedulerState, before: SchedulerState, prev: InFlight,
                dropped: set[str]) -> list[RequestOutput]:
        """Wait for `prev`'s tokens, verify its drafts and update; none of `dropped`'s (the
        next drafts follow `self.plan`, dispatched since)."""
        e = self.engine
        step_outputs.take_prompt_logprobs(e, prev, dropped)
        rows = e.runner.collect_rows(prev)
        if dropped:
            rows = {r: t for r, t in rows.items() if r not in dropped}
        sampled, spec_stats = step_outputs.verify(e, prev.plan, rows, dropped)
        return step_outputs.update(e, state, before, prev.plan, sampled,
                                   spec_decoding=spec_stats, in_flight=self.plan)

    def drop(self, request_ids: Iterable[str]) -> None:
        """These requests left: tokens the step in flight samples for them are stale (an id
        may be reused by a new request before that step is collected)."""
        if self.plan is not None:
            self._dropped.update(r for r in request_ids if r in self.plan.num_scheduled_tokens)
