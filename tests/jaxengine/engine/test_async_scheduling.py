"""`async_scheduling=True` gives exactly the synchronous loop's outputs (docs/DESIGN.md, "Async
scheduling"): the same tokens, text, logprobs and finish reasons for greedy and seeded sampling,
stop strings and stop tokens, min_tokens, preemption, prefix caching and aborts, with no KV
block lost and nothing compiled beyond the synchronous loop's programs."""

from __future__ import annotations

from typing import Any

import pytest

from scheduler import SamplingParams, check_invariants
from tests.jaxengine.engine.test_llm_engine import EOS, PROMPTS, make_engine


def run(prompts: list[list[int]], params: SamplingParams | list[SamplingParams], *,
        async_scheduling: bool, aborts: dict[int, list[str]] | None = None, **kw: Any
        ) -> tuple[dict[str, tuple], Any]:
    """Every prompt to the end (aborting `aborts[step]` before that step); per request
    (token ids, text, finish reason, stop reason, logprobs), and the engine."""
    engine = make_engine(async_scheduling=async_scheduling, **kw)
    for i, p in enumerate(prompts):
        sp = params[i] if isinstance(params, list) else params
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    done, steps = {}, 0
    outputs = []
    while engine.has_unfinished_requests():
        steps += 1
        for rid in (aborts or {}).get(steps, []):
            outputs += engine.abort_request(rid)
        outputs += engine.step()
        check_invariants(engine.state)
    for out in outputs:
        if out.finished:
            c = out.outputs[0]
            lps = None if c.logprobs is None else [
                sorted((t, round(lp.logprob, 5)) for t, lp in d.items()) for d in c.logprobs]
            done[out.request_id] = (tuple(c.token_ids), c.text, c.finish_reason,
                                    c.stop_reason, lps)
    # The last step's tokens may still be in flight: nothing may be lost when it is collected.
    assert engine.step() == []
    assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1
    return done, engine


def both(prompts, params, **kw) -> dict[str, tuple]:
    sync, _ = run(prompts, params, async_scheduling=False, **kw)
    asyn, engine = run(prompts, params, async_scheduling=True, **kw)
    assert asyn == sync
    assert len(sync) == len(prompts)
    return sync


def test_greedy_and_preemption_and_prefix_caching() -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    both(PROMPTS, greedy)
    _, tight = run(PROMPTS, greedy, async_scheduling=True, num_blocks=18)
    assert tight.state.stats.num_preemptions > 0  # the tight pool below does preempt
    both(PROMPTS, greedy, num_blocks=18)
    shared = list(range(50, 82))
    prompts = [shared + [i, i + 1] for i in range(5)]
    out = both(prompts, greedy, max_num_seqs=2)
    assert len(out) == 5


def test_seeded_sampling_with_logprobs() -> None:
    params = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=i, logprobs=2,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    both(PROMPTS, params)
    unseeded = SamplingParams(max_tokens=10, temperature=0.8, ignore_eos=True)
    both(PROMPTS, unseeded)  # engine-drawn seeds: the same draws in both loops


@pytest.mark.parametrize("min_tokens", [0, 5])
def test_stop_strings_stop_tokens_and_eos(min_tokens: int) -> None:
    # A string and a token that do occur, taken from a synchronous greedy run.
    probe, _ = run(PROMPTS[:2], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                   async_scheduling=False)
    stop_string, stop_token = probe["r0"][1][6:8], probe["r1"][0][6]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, stop=[stop_string], min_tokens=min_tokens),
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_token],
                       min_tokens=min_tokens),
        SamplingParams(max_tokens=40, temperature=1.0, seed=3, min_tokens=min_tokens),
    ]
    out = both(PROMPTS[:3] * 3, params * 3)
    for i in (0, 3, 6):  # the stop string ends them, and is not in the text
        assert out[f"r{i}"][2:4] == ("stop", stop_string)
        assert stop_string not in out[f"r{i}"][1]
    for i in (1, 4, 7):
        assert out[f"r{i}"][2:4] == ("stop", stop_token)
    for i in (2, 5, 8):  # sampled: EOS (if drawn) ends them, never mid-output
        assert EOS not in out[f"r{i}"][0][:-1]


def test_aborts_in_flight_lose_no_blocks_and_leave_others_alone() -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    aborts = {3: ["r0"], 5: ["r3", "r5"]}
    sync, _ = run(PROMPTS, greedy, async_scheduling=False, aborts=aborts)
    asyn, _ = run(PROMPTS, greedy, async_scheduling=True, aborts=aborts)
    for rid, (ids, _text, reason, *_rest) in sync.items():
        if reason == "abort":  # aborted between steps: async has applied one step fewer
            assert asyn[rid][2] == "abort"
            assert asyn[rid][0] in (ids, ids[:-1])
        else:
            assert asyn[rid] == sync[rid]


def test_a_reused_request_id_never_gets_the_old_requests_token() -> None:
    """Abort a request while its step is in flight and add a new one under the same id: the
    stale token is dropped, the new request's output is its own."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = make_engine(async_scheduling=True)
    engine.add_request("x", {"prompt_token_ids": [5, 6, 7]}, greedy)
    engine.step()
    engine.step()  # x's first decode is in flight
    engine.abort_request("x")
    engine.add_request("x", {"prompt_token_ids": [40, 41, 42, 43]}, greedy)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    ref, _ = run([[40, 41, 42, 43]], greedy, async_scheduling=False)
    assert outs[-1].outputs[0].token_ids == ref["r0"][0]


def test_no_compilation_beyond_the_synchronous_programs() -> None:
    """The step reads placeholders through the same program as a synchronous step."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = make_engine(async_scheduling=True, precompile=True, debug_recompiles=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, greedy)
    while engine.has_unfinished_requests():
        engine.step()  # debug_recompiles: a compilation here raises
    assert engine.runner.stats.compilations_after_warmup == 0
