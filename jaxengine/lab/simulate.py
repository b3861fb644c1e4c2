"""The simulator: the real pure scheduler against a calibrated cost model, on a virtual clock.

No weights are loaded and nothing runs on a device. The loop is `LLMEngine.step()`'s, call for
call, inside the online loop of a real replay (`jaxengine.lab.bench`):

- requests whose `arrival_time` has passed on the virtual clock are added (in arrival order);
  when none is unfinished, the clock jumps to the next arrival;
- one call schedules the next plan (`scheduler.schedule`), then completes a plan: its own
  (synchronous loop) or the one the call before dispatched (async scheduling, the default),
  whose sampled tokens (a fixed token; EOS is ignored, so only `max_tokens` ends a request) go
  to `scheduler.update_from_output`; the clock advances by the cost model's price of the call;
- request times are stamped as the engine stamps them (first scheduled at the start of a call,
  tokens and finishes at its end), so the results read like a real run's.

Every call also leaves a `jaxengine.lab.timeline.StepRecord` (with its predicted seconds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jaxengine.config import EngineConfig
from jaxengine.engine.args import EngineArgs
from jaxengine.engine.engine_config import create_engine_config
from jaxengine.engine.outputs import RequestMetrics
from jaxengine.lab.cost_model import (
    CALIBRATION_KEYS,
    CostModel,
    engine_buckets,
    engine_request_buckets,
)
from jaxengine.lab.results import RunResult, request_result
from jaxengine.lab.timeline import step_record
from jaxengine.lab.workloads import Workload, WorkloadRequest
from scheduler import (
    Request,
    SamplingParams,
    SchedulerOutput,
    SchedulerState,
    add_request,
    init_state,
    schedule,
    update_from_output,
)

SAMPLED_TOKEN = 7  # what every simulated sampler returns (EOS is ignored)


def simulation_args(cost: CostModel, overrides: Mapping[str, Any] | None = None) -> EngineArgs:
    """The engine arguments of a simulation: the cost model's, with `overrides` applied.

    Raises:
      ValueError: an override of an argument the cost model is only valid for (the model,
        dtype, attention backend, tensor parallel size, async scheduling), or a bad value.
    """
    overrides = dict(overrides or {})
    for key in CALIBRATION_KEYS:
        if key in overrides and overrides[key] != cost.engine_args.get(key):
            raise ValueError(f"the cost model was calibrated with {key}="
                             f"{cost.engine_args.get(key)!r}, not {overrides[key]!r}; run "
                             f"`jaxengine calibrate` with {key}={overrides[key]!r} for that")
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    base = {k: v for k, v in cost.engine_args.items() if k in known}
    return EngineArgs.from_kwargs(**(base | overrides))


def simulation_config(args: EngineArgs, cost: CostModel) -> EngineConfig:
    """The `EngineConfig` an engine built from `args` would resolve on the calibrated machine
    (`create_engine_config`, with the model's limit, per-token KV bytes and KV budget the
    cost model recorded).

    Raises:
      ValueError: what `create_engine_config` raises: max_model_len beyond the model's limit,
        or a pool that cannot hold one request of max_model_len tokens.
    """
    return create_engine_config(
        args, model_max_model_len=cost.model_max_model_len,
        kv_bytes_per_block=cost.kv_bytes_per_token * args.block_size,
        device_kv_budget_bytes=cost.kv_budget_bytes)


def scheduler_request(r: WorkloadRequest, arrival_time: float) -> Request:
    """The scheduler's `Request` of a workload request (greedy, exactly max_tokens)."""
    return Request(request_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                   sampling_params=SamplingParams(max_tokens=r.max_tokens, temperature=0.0,
                                                  ignore_eos=True),
                   arrival_time=arrival_time, priority=r.priority,
                   metadata={"tenant": r.tenant} if r.tenant is not None else {})


@dataclass(slots=True)
class _Tracked:
    """A simulated request's engine-side times (as `TrackedRequest` keeps them)."""

    metrics: RequestMetrics
    num_cached_tokens: int = 0


class Simulation:
    """One simulated run; `run()` drives it to the end. `plans` keeps every plan if asked."""

    def __init__(self, workload: Workload, cost: CostModel, args: EngineArgs, *,
                 keep_plans: bool = False) -> None:
        self.workload, self.cost, self.args = workload, cost, args
        self.config = simulation_config(args, cost).scheduler
        self.buckets = engine_buckets(self.config.max_num_batched_tokens,
                                      intermediate=args.intermediate_token_buckets)
        self.request_buckets = engine_request_buckets(self.config.max_num_seqs)
        self.state: SchedulerState = init_state(self.config)
        self.clock = 0.0
        self.records: list[dict[str, Any]] = []
        self.plans: list[SchedulerOutput] | None = [] if keep_plans else None
        self._tracked: dict[str, _Tracked] = {}
        self._done: dict[str, _Tracked] = {}
        self._in_flight: SchedulerOutput | None = None  # async: dispatched, not completed
        self._dropped: set[str] = set()

    def run(self) -> RunResult:
        """Simulate every request to its end; the run's result (with step records)."""
        pending = self.workload.by_arrival
        i = 0
        for r in pending:
            if len(r.prompt_token_ids) + r.max_tokens > self.config.max_model_len:
                raise ValueError(f"request {r.request_id!r}: prompt ({len(r.prompt_token_ids)}"
                                 f") + max_tokens ({r.max_tokens}) exceeds max_model_len="
                                 f"{self.config.max_model_len}")
            if max(r.prompt_token_ids) >= self.cost.vocab_size:
                raise ValueError(f"request {r.request_id!r}: token id "
                                 f"{max(r.prompt_token_ids)} is beyond the calibrated model's "
                                 f"vocabulary of {self.cost.vocab_size} (make the workload "
                                 f"with --vocab-size {self.cost.vocab_size})")
        while i < len(pending) or self._tracked:
            while i < len(pending) and pending[i].arrival_time <= self.clock:
                self._add(pending[i])
                i += 1
            if not self._tracked:
                self.clock = max(self.clock, pending[i].arrival_time)
                continue
            self._call()
        return self._result()

    def _add(self, r: WorkloadRequest) -> None:
        self.state = add_request(self.state, scheduler_request(r, r.arrival_time))
        self._tracked[r.request_id] = _Tracked(RequestMetrics(arrival_time=r.arrival_time))

    def _call(self) -> None:
        """One `LLMEngine.step()` call."""
        before, start = self.state, self.clock
        state, plan = schedule(before)
        if self.plans is not None:
            self.plans.append(plan)
        for rid in plan.num_scheduled_tokens:
            t = self._tracked[rid]
            if t.metrics.first_scheduled_time is None:
                t.metrics = dataclasses.replace(t.metrics, first_scheduled_time=start)
                t.num_cached_tokens = plan.num_computed_tokens[rid]
        if self.args.async_scheduling:
            completed, self._in_flight = self._in_flight, (
                plan if plan.num_scheduled_tokens else None)
        else:
            completed = plan if plan.num_scheduled_tokens else None
        seconds = self.cost.step_seconds(completed, self.buckets, self.request_buckets)
        self.clock += seconds
        record = step_record(before, state, plan, time_s=start)
        self.records.append({**dataclasses.asdict(record), "seconds": seconds})
        self.state = state
        if completed is not None:
            self._complete(completed)

    def _complete(self, plan: SchedulerOutput) -> None:
        """Take `plan`'s sampled tokens into the state; stamp the requests at the clock."""
        dropped, self._dropped = self._dropped, set()
        sampled = {rid: [SAMPLED_TOKEN] for rid in plan.sampling_req_ids if rid not in dropped}
        self.state, deltas = update_from_output(self.state, plan, sampled)
        now = self.clock
        for d in deltas:
            t = self._tracked[d.request_id]
            m = t.metrics
            if d.new_token_ids:
                m = dataclasses.replace(
                    m, first_token_time=m.first_token_time or now, last_token_time=now,
                    num_generation_tokens=m.num_generation_tokens + len(d.new_token_ids))
            if d.finish_reason is not None:
                m = dataclasses.replace(m, finished_time=now)
                self._done[d.request_id] = self._tracked.pop(d.request_id)
                # As the engine does: a finished request's token in the step in flight is stale.
                if (self._in_flight is not None
                        and d.request_id in self._in_flight.num_scheduled_tokens):
                    self._dropped.add(d.request_id)
            t.metrics = m

    def _result(self) -> RunResult:
        done = self._done
        requests = tuple(request_result(r, done[r.request_id].metrics,
                                        num_cached_tokens=done[r.request_id].num_cached_tokens)
                         for r in self.workload.requests)
        duration = max(t.metrics.finished_time or 0.0 for t in done.values())
        info = {"kind": "simulated", "engine_args": dataclasses.asdict(self.args),
                "num_blocks": self.config.num_blocks, "steps": len(self.records),
                "cost_model_device": self.cost.device}
        return RunResult(duration=duration, requests=requests, steps=tuple(self.records),
                         info=info)


def simulate(workload: Workload, cost: CostModel, args: EngineArgs | None = None) -> RunResult:
    """Simulate `workload` under `args` (default: the cost model's own arguments).

    Raises:
      ValueError: arguments the cost model cannot price or the engine would refuse, or a
        request longer than max_model_len.
    """
    return Simulation(workload, cost, args or simulation_args(cost)).run()
