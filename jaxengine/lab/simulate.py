"""The simulator: a real `LLMEngine` against a calibrated cost model, on a virtual clock.

No weights are loaded and nothing runs on a device. The engine is built from the simulated
engine arguments, its own step loop (`jaxengine.engine.loops`) and scheduler included, with
two things swapped through its constructor: its runner is a
`jaxengine.lab.cost_runner.CostModelRunner` (each step's tokens at once, a fixed token per
sampling request; EOS is ignored, so only `max_tokens` ends a request) and its clock a
`VirtualClock` that runner advances by the cost model's price of each engine call. Around it
runs the online loop of a real replay (`jaxengine.lab.bench`): requests whose `arrival_time`
has passed on the virtual clock are added (in arrival order); when none is unfinished, the
clock jumps to the next arrival; otherwise the engine steps. The engine stamps the request
times itself (first scheduled at the start of a call, tokens and finishes at its end), so the
results read like a real run's.

Every call also leaves a `jaxengine.lab.timeline.StepRecord` (with its predicted seconds),
made from the engine's `on_schedule`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxengine.config import EngineConfig
from jaxengine.engine.args import EngineArgs
from jaxengine.engine.engine_config import create_engine_config
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine.outputs import RequestOutput
from jaxengine.lab.cost_model import CALIBRATION_KEYS, CostModel
from jaxengine.lab.cost_runner import CostModelRunner, VirtualClock
from jaxengine.lab.results import RunResult, request_result
from jaxengine.lab.timeline import StepRecord, step_record
from jaxengine.lab.workloads import Workload, WorkloadRequest
from jaxengine.model.fake import fake_model
from scheduler import RequestOutputKind, SamplingParams, SchedulerOutput, SchedulerState


def simulation_args(cost: CostModel, overrides: Mapping[str, Any] | None = None) -> EngineArgs:
    """The engine arguments of a simulation: the cost model's, with `overrides` applied.

    Raises:
      ValueError: an override of an argument the cost model is only valid for (the model,
        dtypes, attention backend, tensor parallel size, async scheduling), or a bad value.
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


def _check_simulatable(args: EngineArgs) -> None:
    """Refuse the engine arguments the cost model cannot price (their steps do other work)."""
    for name in ("speculative_config", "kv_offloading_size"):
        if getattr(args, name) is not None:
            raise ValueError(f"the simulator does not price {name}; simulate without it "
                             f"(got {name}={getattr(args, name)!r})")


# A step record's fields, all numbers: its dict is read field by field (`asdict` deep-copies).
_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(StepRecord))


class Simulation:
    """One simulated run of a real `LLMEngine` (with the cost-model runner and a virtual clock);
    `run()` drives it to the end. `plans` keeps every plan if asked."""

    def __init__(self, workload: Workload, cost: CostModel, args: EngineArgs, *,
                 keep_plans: bool = False) -> None:
        _check_simulatable(args)
        self.workload, self.cost, self.args = workload, cost, args
        engine_config = simulation_config(args, cost)
        self.config = engine_config.scheduler
        self.clock = VirtualClock()
        self.records: list[dict[str, Any]] = []
        self.plans: list[SchedulerOutput] | None = [] if keep_plans else None
        self._record: StepRecord | None = None  # of the engine call under way
        self.engine = LLMEngine(
            fake_model(cost.vocab_size), args, engine_config, tokenizer=None,
            make_runner=lambda _, config: CostModelRunner(
                config, cost, self.clock, async_scheduling=args.async_scheduling),
            clock=self.clock, on_schedule=self._scheduled)
        self.runner: CostModelRunner = self.engine.runner
        self._done: dict[str, RequestOutput] = {}

    def run(self) -> RunResult:
        """Simulate every request to its end; the run's result (with step records)."""
        pending = self.workload.by_arrival
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
        engine, i = self.engine, 0
        while i < len(pending) or engine.has_unfinished_requests():
            while i < len(pending) and pending[i].arrival_time <= self.clock.now:
                self._add(pending[i])
                i += 1
            if not engine.has_unfinished_requests():
                self.clock.now = max(self.clock.now, pending[i].arrival_time)
                continue
            outputs = engine.step()
            record = self._record
            self.records.append({f: getattr(record, f) for f in _RECORD_FIELDS}
                                | {"seconds": self.runner.last_seconds})
            self._done.update((o.request_id, o) for o in outputs if o.finished)
        return self._result()

    def _add(self, r: WorkloadRequest) -> None:
        """Add a request as a client would: greedy, exactly max_tokens, at its arrival time;
        only its final output is read (its metrics), so only that one is built."""
        self.engine.add_request(
            r.request_id, list(r.prompt_token_ids),
            SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True,
                           output_kind=RequestOutputKind.FINAL_ONLY),
            arrival_time=r.arrival_time, priority=r.priority,
            metadata={"tenant": r.tenant} if r.tenant is not None else None)

    def _scheduled(self, before: SchedulerState, after: SchedulerState,
                   plan: SchedulerOutput) -> None:
        """The engine's `on_schedule`: the call's step record, at its start."""
        self._record = step_record(before, after, plan, time_s=self.clock.now)
        if self.plans is not None:
            self.plans.append(plan)

    def _result(self) -> RunResult:
        done = self._done
        requests = tuple(request_result(r, done[r.request_id].metrics,
                                        num_cached_tokens=done[r.request_id].num_cached_tokens)
                         for r in self.workload.requests)
        duration = max(o.metrics.finished_time or 0.0 for o in done.values())
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
