"""The simulator's runner: the real engine's loop calls it as it calls `Runner`, and it answers
at once, with a fixed token per sampling request, having advanced a virtual clock by the cost
model's price of the engine call.

`LLMEngine(make_runner=..., clock=...)` is the seam, as `ModelFns` is the fake model's: the
engine's loops call `dispatch` once per `step()` and `collect_rows` / `collect_prompt_logprobs`
for the step they finish, so the price of a call is charged at its dispatch, before the engine
stamps that call's tokens and finishes:

- the synchronous loop finishes the plan it dispatches: the call costs that plan's price;
- the async loop finishes the step dispatched by the call before (`prev`): the call costs
  `prev`'s plan's price, or `idle_call_seconds` when there is none (the first call, or the one
  after an empty plan).

A structured-output request's split dispatch (`dispatch_forward` / `dispatch_sample`) is not
priced: the simulator adds no grammar requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from jaxengine.lab.cost_model import CostModel
from jaxengine.runner.config import RunnerConfig
from jaxengine.runner.in_flight import SampledToken
from jaxengine.sampling.rows import SamplingRow
from scheduler import SchedulerOutput

SAMPLED_TOKEN = 7  # what every simulated sampler returns (EOS is ignored)
_SAMPLED = SampledToken(SAMPLED_TOKEN, None)  # a frozen value: every row shares it


class VirtualClock:
    """The simulated run's seconds: the engine reads it, the cost runner advances it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        """Seconds since the run's start (the engine's `clock`)."""
        return self.now


@dataclass(frozen=True, slots=True)
class PricedStep:
    """A dispatched simulated step (the runner's `InFlight`): all the loops read is its plan."""

    plan: SchedulerOutput


class CostModelRunner:
    """`Runner`'s interface to the engine's loops, priced by a `CostModel`; no device."""

    def __init__(self, config: RunnerConfig, cost: CostModel, clock: VirtualClock, *,
                 async_scheduling: bool) -> None:
        """Args:
          config: the runner sizes the engine derived (the token and sampler buckets follow
            from them, as `Runner` builds them).
          cost: prices a call from the plan it finishes.
          clock: the engine's clock, advanced by every `dispatch`.
          async_scheduling: the engine's loop (which plan a call finishes).
        """
        self.config, self.cost, self.clock = config, cost, clock
        self.async_scheduling = async_scheduling
        self.token_buckets, self.request_buckets = config.buckets()
        self.last_seconds = 0.0  # the price of the last call

    def precompile(self, *, background: bool = False) -> None:
        """Nothing compiles, here or in the background."""

    def shutdown(self) -> None:
        """Nothing runs in the background to stop."""

    def dispatch(self, out: SchedulerOutput, rows: Mapping[str, SamplingRow],
                 prev: PricedStep | None = None, *, lora_slots: Mapping[str, int] | None = None
                 ) -> PricedStep | None:
        """Charge this engine call's price to the clock; the step (None if `out` schedules
        nothing). `lora_slots` is always None: an engine over this runner refuses
        `enable_lora`."""
        finished = out if not self.async_scheduling else None if prev is None else prev.plan
        self.last_seconds = self.cost.step_seconds(finished, self.token_buckets,
                                                   self.request_buckets)
        self.clock.now += self.last_seconds
        return PricedStep(out) if out.num_scheduled_tokens else None

    @staticmethod
    def collect_rows(step: PricedStep) -> dict[str, list[SampledToken]]:
        """`SAMPLED_TOKEN` for each sampling request of the step."""
        return {r: [_SAMPLED] for r in step.plan.sampling_req_ids}

    @staticmethod
    def collect_prompt_logprobs(step: PricedStep) -> dict:
        """None asked (the simulator's requests ask no prompt logprobs)."""
        return {}
