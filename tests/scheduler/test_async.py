"""Async scheduling (docs/SCHEDULING.md §4.1): step N+1 is planned before step N's tokens are
known, with placeholders; the tokens every request gets are those of the synchronous loop.

The fake "device" keeps each request's true sequence (it knows every token the moment it is
sampled, as the real device does) and checks that each plan's inputs, placeholders filled from
the step in flight, are exactly that sequence; its token is a hash of the sequence before it.
"""

import random

import pytest

from scheduler import (
    PLACEHOLDER_TOKEN_ID,
    SchedulerConfig,
    abort_requests,
    add_request,
    check_invariants,
    init_state,
    schedule,
    update_from_output,
)
from tests.scheduler.util import req

VOCAB = 50


class Device:
    """True sequences, as the model sees them; tokens are a function of the prefix."""

    def __init__(self, eos: int | None) -> None:
        self.seq: dict[str, list[int]] = {}
        self.eos = eos

    def run(self, plan, prompts):
        """Check the plan's inputs against the true sequences; sample; return {rid: [tok]}."""
        out = {}
        for rid, n in plan.num_scheduled_tokens.items():
            seq = self.seq.setdefault(rid, list(prompts[rid]))
            start = plan.num_computed_tokens[rid]
            ids = plan.input_token_ids[rid]
            assert len(ids) == n
            for k, t in enumerate(ids):  # a placeholder is the token sampled last step
                assert t == PLACEHOLDER_TOKEN_ID or t == seq[start + k], (rid, start + k)
                assert start + k < len(seq), f"{rid}: input past what the device has sampled"
            if rid in plan.sampling_req_ids:
                end = start + n
                del seq[end:]  # a request that finished or was preempted may diverge here
                token = hash((rid, tuple(seq))) % VOCAB
                seq.append(token)
                out[rid] = [token]
        return out


def drive(config, requests, *, async_, aborts=(), eos=None, max_steps=5000):
    """Run to completion; returns {rid: (output tokens, finish reason)} and the step count."""
    s = init_state(config)
    prompts = {r.request_id: r.prompt_token_ids for r in requests}
    for r in requests:
        s = add_request(s, r)
    device, results, inflight, steps = Device(eos), {}, None, 0

    def apply(s, plan, sampled):
        s, deltas = update_from_output(s, plan, sampled)
        check_invariants(s)
        for d in deltas:
            tokens, _ = results.get(d.request_id, ((), None))
            results[d.request_id] = (tokens + d.new_token_ids, d.finish_reason)
        return s

    while s.requests or inflight is not None:
        steps += 1
        assert steps < max_steps
        for at, rid in aborts:
            if at == steps:
                s = abort_requests(s, [rid])
                tokens, _ = results.get(rid, ((), None))
                results[rid] = (tokens, "abort")
        s, plan = schedule(s)
        check_invariants(s, plan)
        sampled = device.run(plan, prompts)
        if not async_:
            s = apply(s, plan, sampled)
            continue
        if inflight is not None:
            s = apply(s, *inflight)
        inflight = (plan, sampled) if plan.num_scheduled_tokens else None
    assert s.num_free_blocks == config.num_blocks - 1  # every block came back
    return results, steps


def workload(seed, n, *, eos=None, shared_prefix=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(shared_prefix)]
    out = []
    for i in range(n):
        prompt = prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        max_tokens = rng.randint(1, 30)
        out.append(req(f"r{i}", prompt, max_tokens=max_tokens, eos=eos, arrival=float(i),
                       min_tokens=min(max_tokens, rng.choice([0, 0, 3]))))
    return out


CONFIGS = {
    "roomy": dict(num_blocks=200),
    "preempting": dict(num_blocks=20),  # 19 usable blocks of 4 tokens: requests get preempted
    "chunked": dict(num_blocks=64, max_num_batched_tokens=16, max_num_seqs=4),
    "no-cache": dict(num_blocks=40, enable_prefix_caching=False),
    "priority": dict(num_blocks=20, policy="priority"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", range(4))
def test_async_outputs_equal_sync(name, seed):
    kw = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=80, block_size=4)
    kw |= CONFIGS[name]
    eos = 3 if seed % 2 else None  # with EOS, requests stop at different points
    requests = workload(seed, 12, eos=eos, shared_prefix=8 if seed >= 2 else 0)
    sync, _ = drive(SchedulerConfig(**kw), requests, async_=False)
    asyn, _ = drive(SchedulerConfig(**kw, async_scheduling=True), requests, async_=True)
    assert asyn == sync
    assert len(sync) == len(requests)


def test_preemption_happens_in_the_preempting_config():
    """The config meant to preempt does, under async scheduling too (else the test above
    would not cover a request preempted while its token is in flight)."""
    kw = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=80, block_size=4,
              num_blocks=20, async_scheduling=True)
    s = init_state(SchedulerConfig(**kw))
    for r in workload(0, 12):
        s = add_request(s, r)
    device, inflight = Device(None), None
    prompts = {r.request_id: r.prompt_token_ids for r in workload(0, 12)}
    preempted_in_flight = 0
    while s.requests:
        s, plan = schedule(s)
        if inflight is not None:
            preempted_in_flight += len(plan.preempted_req_ids & set(inflight[0].sampling_req_ids))
        sampled = device.run(plan, prompts)
        if inflight is not None:
            s, _ = update_from_output(s, *inflight)
        inflight = (plan, sampled)
    assert preempted_in_flight > 0


def test_aborts_while_in_flight_leak_no_tokens_or_blocks():
    kw = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=80, block_size=4,
              num_blocks=40)
    requests = workload(1, 8)
    aborts = [(3, "r0"), (5, "r3"), (9, "r5")]
    sync, _ = drive(SchedulerConfig(**kw), requests, async_=False, aborts=aborts)
    asyn, _ = drive(SchedulerConfig(**kw, async_scheduling=True), requests, async_=True,
                    aborts=aborts)
    # An abort lands between steps, when the async loop has applied one step fewer: an aborted
    # request may hold one token less (the one in flight is dropped). Others are unaffected.
    for rid, (tokens, reason) in sync.items():
        if reason == "abort":
            assert asyn[rid][1] == "abort"
            assert asyn[rid][0] in (tokens, tokens[:-1])
        else:
            assert asyn[rid] == (tokens, reason)


def test_a_decode_is_planned_with_a_placeholder_and_max_tokens_ends_planning():
    """After the prompt's step, the next decode's input is a placeholder; a request whose step
    in flight gives it its last token (max_tokens) is not planned again."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64,
                          block_size=4, num_blocks=20, async_scheduling=True)
    s = add_request(init_state(cfg), req("a", 5, max_tokens=2))
    s, p1 = schedule(s)  # the prompt; samples output 0
    assert p1.sampling_req_ids == ("a",) and s.requests["a"].num_output_placeholders == 1
    s, p2 = schedule(s)  # output 1, from the placeholder of output 0
    assert p2.input_token_ids["a"] == (PLACEHOLDER_TOKEN_ID,)
    assert s.requests["a"].num_output_placeholders == 2
    s, _ = update_from_output(s, p1, {"a": [9]})
    s, p3 = schedule(s)  # output 1 is in flight and is the last: nothing to plan
    assert dict(p3.num_scheduled_tokens) == {}
    s, deltas = update_from_output(s, p2, {"a": [8]})
    assert deltas[0].finish_reason == "length" and not s.requests
    check_invariants(s)
    assert s.num_free_blocks == cfg.num_blocks - 1


def test_sync_scheduling_keeps_no_placeholders():
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64,
                          block_size=4, num_blocks=20)
    s = add_request(init_state(cfg), req("a", 5, max_tokens=4))
    s, plan = schedule(s)
    assert s.requests["a"].num_output_placeholders == 0
    s, plan = schedule(s)  # without an update the decode has nothing to compute
    assert dict(plan.num_scheduled_tokens) == {}
