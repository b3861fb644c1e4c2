"""Helpers for scheduler tests: build requests tersely and drive steps with a fake model."""

from collections.abc import Callable, Iterable, Mapping

from scheduler import (
    Request,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerState,
    add_request,
    check_invariants,
    init_state,
    schedule,
    update_from_output,
)


def req(rid: str, prompt: int | Iterable[int], max_tokens: int = 16, *, arrival: float = 0.0,
        priority: int = 0, eos: int | None = None, salt: str | None = None,
        **params) -> Request:
    """A request; an int prompt means that many distinct tokens derived from the id."""
    if isinstance(prompt, int):
        base = 1000 * (sum(map(ord, rid)) % 97 + 1)
        prompt = range(base, base + prompt)
    return Request(request_id=rid, prompt_token_ids=tuple(prompt),
                   sampling_params=SamplingParams(max_tokens=max_tokens, **params),
                   arrival_time=arrival, priority=priority, eos_token_id=eos, cache_salt=salt)


def state_with(config: SchedulerConfig, *requests: Request) -> SchedulerState:
    s = init_state(config)
    for r in requests:
        s = add_request(s, r)
    return s


Sampler = Callable[[str, SchedulerOutput], list[int]]


def step(s: SchedulerState, sampler: Sampler | int = 7, stopped: Mapping[str, str] | None = None):
    """One schedule + update with a fake model (`stopped`: the stop strings its detokenizer
    found); checks invariants. Returns (state, plan, deltas)."""
    s, out = schedule(s)
    check_invariants(s, out)
    if isinstance(sampler, int):
        token = sampler
        sampled = {rid: [token] for rid in out.sampling_req_ids}
    else:
        sampled = {rid: sampler(rid, out) for rid in out.sampling_req_ids}
    s, deltas = update_from_output(s, out, sampled, stopped=stopped)
    check_invariants(s)
    return s, out, deltas


def run(config: SchedulerConfig, arrivals: dict[int, list[Request]], max_steps: int = 10_000):
    """Replay-like driver: returns (final state, per-step records as (scheduled dict,
    preempted set, finished list, free blocks))."""
    s = init_state(config)
    records = []
    last = max(arrivals, default=0)
    for i in range(max_steps):
        for r in arrivals.get(i, ()):
            s = add_request(s, r)
        if i > last and not s.requests:
            return s, records
        s, out, deltas = step(s)
        records.append((dict(out.num_scheduled_tokens), set(out.preempted_req_ids),
                        [d.request_id for d in deltas if d.finish_reason], s.num_free_blocks))
    raise AssertionError("did not finish")
