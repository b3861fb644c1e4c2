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
            drafts = plan.scheduled_spec_decode_tokens.get(rid, ())
            assert ids[n - len(drafts):] == drafts  # a verified step's inputs end in its drafts
            for k, t in enumerate(ids[:n - len(drafts)]):  # a placeholder: sampled last step
                assert t == PLACEHOLDER_TOKEN_ID or t == seq[start + k], (rid, start + k)
                assert start + k < len(seq), f"{rid}: input past what the device has sampled"
            if rid in plan.sampling_req_ids:
                del seq[start + n - len(drafts):]  # a finished or preempted request may diverge
                out[rid] = []
                for d in (*drafts, None):  # x_0, then x_{j+1} while x_j == d_j
                    token = true_token(rid, seq)
                    seq.append(token)
                    out[rid].append(token)
                    if token != d:
                        break
        return out


def true_token(rid: str, seq) -> int:
    """The fake model's next token after `seq`."""
    return hash((rid, tuple(seq))) % VOCAB


class Drafts:
    """Drafts as the engine proposes them (jaxengine/spec): after a request's known tokens,
    and under async scheduling past the token a plain decode in flight samples (guessed:
    `lag` 1), none while a step in flight verifies its drafts. The guesses are the true
    continuation, one of them made wrong at a random place (or none), so drafts are accepted
    and rejected. Counts what it proposed and what the steps accepted."""

    def __init__(self, k: int, seed: int) -> None:
        self.k, self.rng = k, random.Random(seed)
        self.proposed = self.accepted = self.sat_out = 0

    def propose(self, s, plan, sampled, results, in_flight):
        drafts = {}
        for rid, tokens in sampled.items():
            if rid not in s.requests:
                continue  # aborted while its step ran
            req = s.requests[rid]
            history = [*req.prompt_token_ids, *results.get(rid, ((), None))[0], *tokens]
            lag = 0
            if in_flight is not None and rid in in_flight.sampling_req_ids:
                if rid in in_flight.scheduled_spec_decode_tokens:
                    continue  # its drafts are in flight: no proposal
                lag = 1
            max_tokens = req.sampling_params.max_tokens
            room = min(self.k, req_room(s, rid, len(history) + lag, max_tokens))
            if room <= 0:
                continue
            guess = []
            for _ in range(room + lag):
                guess.append(true_token(rid, history + guess))
            wrong = self.rng.randrange(len(guess) + 1)
            if wrong < len(guess):
                guess[wrong] = (guess[wrong] + 1) % VOCAB
            drafts[rid] = guess[lag:]
            self.proposed += room
        return drafts

    def count(self, plan, sampled):
        for rid in plan.scheduled_spec_decode_tokens:
            self.accepted += len(sampled.get(rid, [None])) - 1


def req_room(s, rid, num_tokens, max_tokens):
    """Drafts a request with `num_tokens` (known and in flight) may get: what max_tokens and
    max_model_len leave to verify."""
    num_output = num_tokens - s.num_prompt_tokens(rid)
    room = s.config.max_model_len - num_tokens - 1
    return room if max_tokens is None else min(room, max_tokens - num_output - 1)


def drive(config, requests, *, async_, aborts=(), eos=None, max_steps=5000, drafts=None):
    """Run to completion; returns {rid: (output tokens, finish reason)} and the step count.
    With `drafts` (a `Drafts`), each update proposes the next drafts; a request whose drafts
    are in flight must not be in the next plan."""
    s = init_state(config)
    prompts = {r.request_id: r.prompt_token_ids for r in requests}
    for r in requests:
        s = add_request(s, r)
    device, results, inflight, steps = Device(eos), {}, None, 0

    def apply(s, plan, sampled, in_flight=None):
        new = None
        if drafts is not None:
            drafts.count(plan, sampled)
            new = drafts.propose(s, plan, sampled, results, in_flight)
        s, deltas = update_from_output(s, plan, sampled, new)
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
            sat_out = set(inflight[0].scheduled_spec_decode_tokens)
            assert not sat_out & set(plan.num_scheduled_tokens), "drafts in flight, scheduled"
            if drafts is not None:
                drafts.sat_out += len(sat_out)
            s = apply(s, *inflight, plan)
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


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", range(3))
def test_async_outputs_with_drafts_equal_sync(name, seed):
    """Drafts (accepted, partly, or not at all; lagged behind a decode in flight) change no
    request's tokens under async scheduling, and nothing leaks."""
    kw = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=80, block_size=4)
    kw |= CONFIGS[name]
    eos = 3 if seed % 2 else None
    requests = workload(seed, 12, eos=eos, shared_prefix=8 if seed >= 2 else 0)
    plain, _ = drive(SchedulerConfig(**kw), requests, async_=False)
    sync, _ = drive(SchedulerConfig(**kw), requests, async_=False, drafts=Drafts(3, seed))
    drafts = Drafts(3, seed)
    asyn, _ = drive(SchedulerConfig(**kw, async_scheduling=True), requests, async_=True,
                    drafts=drafts)
    assert asyn == sync == plain
    assert drafts.accepted > 0 and drafts.sat_out > 0 and drafts.proposed > drafts.accepted


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


def _drafted_in_flight(max_tokens=20, num_blocks=20):
    """Request "a" (prompt 5) under async scheduling with its drafts (1, 2, 3) in flight, lagged
    behind its plain decode, which has just been updated. Returns (state, the drafts' plan)."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64,
                          block_size=4, num_blocks=num_blocks, async_scheduling=True)
    s = add_request(init_state(cfg), req("a", 5, max_tokens=max_tokens))
    s, p1 = schedule(s)  # the prompt: samples output 0
    s, p2 = schedule(s)  # output 1, from the placeholder of output 0
    s, _ = update_from_output(s, p1, {"a": [9]}, {"a": [1, 2, 3]})  # drafts after output 1
    assert s.requests["a"].num_output_placeholders == 1
    s, p3 = schedule(s)  # output 1's placeholder, then the drafts
    assert p3.input_token_ids["a"] == (PLACEHOLDER_TOKEN_ID, 1, 2, 3)
    assert p3.scheduled_spec_decode_tokens["a"] == (1, 2, 3) and p3.sampling_req_ids == ("a",)
    s, _ = update_from_output(s, p2, {"a": [7]})
    check_invariants(s)
    return s, p3


@pytest.mark.parametrize("sampled, kept", [([1, 2, 8], 3), ([1, 2, 3, 4], 4), ([5], 1)])
def test_a_request_with_drafts_in_flight_sits_out_one_step(sampled, kept):
    s, p3 = _drafted_in_flight()
    assert s.requests["a"].num_computed_tokens == 10  # 5 + outputs 0, 1 + 3 drafts
    s, p4 = schedule(s)  # how many tokens p3 gives it is unknown: it is not planned
    assert dict(p4.num_scheduled_tokens) == {} and s.running == ("a",)
    check_invariants(s, p4)
    s, deltas = update_from_output(s, p3, {"a": sampled})
    assert deltas[0].new_token_ids == tuple(sampled)
    a = s.requests["a"]  # everything owed arrived; the rejected drafts' KV rolled back
    assert a.num_output_placeholders == 0 and a.spec_token_ids == ()
    assert a.output_token_ids == (9, 7, *sampled) and a.num_computed_tokens == 6 + kept
    check_invariants(s)
    s, p5 = schedule(s)  # planned again, from its newest known token
    assert p5.input_token_ids["a"] == (sampled[-1],)
    assert p5.num_computed_tokens["a"] == 6 + kept
    check_invariants(s, p5)


def test_a_request_preempted_or_aborted_with_drafts_in_flight_leaks_nothing():
    # 5 usable blocks of 4 tokens. "b" (prompt 6, admitted first) needs its third block at
    # step 4, when "a" (prompt 5) holds three with its drafts in flight: "a" is preempted.
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64,
                          block_size=4, num_blocks=6, async_scheduling=True)
    s = add_request(init_state(cfg), req("b", 6, max_tokens=4))
    s = add_request(s, req("a", 5, max_tokens=20, arrival=1.0))
    s, p1 = schedule(s)
    s, p2 = schedule(s)
    s, _ = update_from_output(s, p1, {"b": [4], "a": [9]}, {"a": [1, 2, 3]})
    s, p3 = schedule(s)
    assert p3.scheduled_spec_decode_tokens == {"a": (1, 2, 3)} and s.num_free_blocks == 0
    s, _ = update_from_output(s, p2, {"b": [4], "a": [7]})
    s, p4 = schedule(s)
    assert p4.preempted_req_ids == {"a"} and list(p4.num_scheduled_tokens) == ["b"]
    assert s.requests["a"].num_output_placeholders > 0  # its drafts' tokens are still owed
    check_invariants(s, p4)
    s, deltas = update_from_output(s, p3, {"b": [4], "a": [1, 8]})  # arrive while it waits
    a = s.requests["a"]
    assert a.num_output_placeholders == 0 and a.num_computed_tokens == 0
    assert a.output_token_ids == (9, 7, 1, 8) and a.spec_token_ids == ()
    check_invariants(s)
    s, deltas = update_from_output(s, p4, {"b": [4]})
    assert deltas[0].finish_reason == "length"
    s, p5 = schedule(s)  # resumed: it recomputes every known token
    assert p5.input_token_ids["a"][-4:] == (9, 7, 1, 8)
    assert s.requests["a"].num_output_placeholders == 1
    s = abort_requests(s, ["a"])  # aborted with its step in flight
    s, deltas = update_from_output(s, p5, {"a": [5]})  # stale: ignored
    assert deltas == () and not s.requests
    check_invariants(s)
    assert s.num_free_blocks == cfg.num_blocks - 1

    s, p3 = _drafted_in_flight()
    s = abort_requests(s, ["a"])  # aborted while its drafts are in flight
    s, deltas = update_from_output(s, p3, {"a": [1, 2, 3, 4]})  # stale: ignored
    assert deltas == () and not s.requests
    check_invariants(s)
    assert s.num_free_blocks == s.config.num_blocks - 1
