"""Speculative decoding through the engine on the fake model (docs/STYLE.md rule 10): drafts
change no output (greedy, seeded, stops, limits), in the synchronous loop and under async
scheduling, free every block, compile nothing after warm-up, and the tokens accepted rows emit
have the target's distribution."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest

from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.model.fake import LOGIT, fake_greedy, fake_next_token
from jaxengine.spec.speculator import Speculator
from scheduler import SamplingParams, check_invariants
from tests.jaxengine.engine.test_llm_engine import PROMPTS, FakeTokenizer, V, make_engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Both loops: synchronous, and async scheduling (drafts lagged behind a decode in flight).
LOOPS = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


class GreedyDrafts(Speculator):
    """Drafts the fake model's own greedy continuation: forced drafts, all right at
    temperature 0, each accepted with the target's probability of its argmax otherwise."""

    def propose_tokens(self, token_ids: Sequence[int], k: int) -> list[int]:
        return fake_greedy(token_ids, k, V)


class Counts:
    """A stat logger summing the steps' `SpecDecodingStats`."""

    def __init__(self) -> None:
        self.drafts = self.draft_tokens = self.accepted = 0
        self.per_pos: list[int] = []

    def record(self, scheduler_stats: Any, it: Any) -> None:
        s = None if it is None else it.spec_decoding
        if s is not None:
            self.drafts += s.num_drafts
            self.draft_tokens += s.num_draft_tokens
            self.accepted += s.num_accepted_tokens
            self.per_pos = self.per_pos or [0] * s.num_spec_tokens
            self.per_pos = [a + b for a, b in zip(self.per_pos, s.num_accepted_tokens_per_pos,
                                                  strict=True)]


def spec_engine(drafts: type[Speculator] | None = GreedyDrafts, **kw: Any) -> LLMEngine:
    """An engine with ngram speculation; its proposer replaced by `drafts` if given."""
    engine = make_engine(speculative_config=NGRAM, **kw)
    if drafts is not None:
        s = engine.speculator
        assert s is not None
        engine.speculator = drafts(s.config, max_model_len=s.max_model_len,
                                   eos_token_id=s.eos_token_id)
    return engine


def run(engine: LLMEngine, prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams]) -> tuple[dict[str, tuple], int]:
    """Every prompt (text or token ids) to the end; per request (tokens, text, finish and stop
    reason), and the steps it took. Checks the invariants each step and that every block
    comes back."""
    for i, p in enumerate(prompts):
        sp = params if isinstance(params, SamplingParams) else params[i]
        engine.add_request(f"r{i}", p if isinstance(p, str) else {"prompt_token_ids": list(p)},
                           sp)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (tuple(c.token_ids), c.text, c.finish_reason,
                                        c.stop_reason)
        check_invariants(engine.state)
    assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1
    return done, steps


def test_right_and_wrong_drafts_change_no_greedy_output() -> None:
    plain, plain_steps = run(make_engine(async_scheduling=False), PROMPTS, GREEDY)
    counts = Counts()
    engine = spec_engine(async_scheduling=False)
    engine.stat_loggers.append(counts)
    right, right_steps = run(engine, PROMPTS, GREEDY)
    assert right == plain
    for i, p in enumerate(PROMPTS):
        assert list(right[f"r{i}"][0]) == fake_greedy(p, 12, V)
    # Every draft is right: 11 tokens after the first come 4 a step (3 drafts + 1), in 3
    # steps of 3, 3 and 2 drafts; the drafts never exceed what max_tokens leaves.
    assert counts.accepted == counts.draft_tokens == 8 * len(PROMPTS) > 0
    assert counts.drafts == 3 * len(PROMPTS)
    assert counts.per_pos == [3 * len(PROMPTS), 3 * len(PROMPTS), 2 * len(PROMPTS)]
    assert right_steps < plain_steps
    ngram = Counts()  # prompt lookup on the fake model's hash-like outputs: mostly wrong
    engine = spec_engine(drafts=None, async_scheduling=False)
    engine.stat_loggers.append(ngram)
    assert run(engine, PROMPTS, GREEDY)[0] == plain
    assert ngram.draft_tokens > ngram.accepted


def test_async_scheduling_lags_drafts_behind_the_decode_in_flight() -> None:
    """Under async scheduling (kept on with speculation) a request decoded plainly in the step
    in flight gets drafts after that step's token, guessed: the greedy continuation's guess
    is right, so every draft is accepted only if the drafts line up behind it. A step that
    verifies drafts is finished before the next plan, so no request sits a step out: the loop
    takes the synchronous one's steps plus two calls (the plain decode behind the prefill, and
    the last call, which only collects), under half of those without drafts."""
    plain, plain_steps = run(make_engine(), PROMPTS, GREEDY)
    sync, sync_steps = run(spec_engine(async_scheduling=False), PROMPTS, GREEDY)
    counts = Counts()
    engine = spec_engine()
    assert engine.args.async_scheduling and engine.state.config.async_scheduling
    engine.stat_loggers.append(counts)
    lagged: list[int] = []
    record_lagged_drafts(engine, lagged)
    asyn, async_steps = run(engine, PROMPTS, GREEDY)
    assert asyn == sync == plain
    assert counts.accepted == counts.draft_tokens > 0 and sum(lagged) > 0
    assert sync_steps < async_steps < plain_steps
    assert async_steps == sync_steps + 2 and 2 * async_steps <= plain_steps
    ngram = Counts()  # prompt lookup: wrong guesses too, still the same outputs
    engine = spec_engine(drafts=None)
    engine.stat_loggers.append(ngram)
    assert run(engine, PROMPTS, GREEDY)[0] == plain
    assert ngram.draft_tokens > ngram.accepted


def record_lagged_drafts(engine: LLMEngine, seen: list[int]) -> None:
    """Append to `seen`, per proposal, how many drafts follow a decode in flight."""
    propose = engine.speculator.propose  # type: ignore[union-attr]

    def recording(tracked: Any, sampled: Any, stopped: Any, in_flight: Any = None) -> Any:
        drafts = propose(tracked, sampled, stopped, in_flight)
        seen.extend(len(d) for r, d in drafts.items()
                    if in_flight is not None and r in in_flight.sampling_req_ids)
        return drafts

    engine.speculator.propose = recording  # type: ignore[union-attr,method-assign]


@LOOPS
def test_stops_inside_accepted_drafts_end_the_request_there(async_scheduling: bool) -> None:
    probe, _ = run(make_engine(), PROMPTS[:3], GREEDY)
    stop_string = probe["r0"][1][5:7]  # outputs 5 and 6: inside the second verified step
    stop_token = probe["r1"][0][6]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop_string]),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                       stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),  # mid-step length cap
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop_string],
                       include_stop_str_in_output=True),
    ]
    prompts = [*PROMPTS[:3], PROMPTS[0]]
    plain, _ = run(make_engine(), prompts, params)
    engine, counts = counted(spec_engine(async_scheduling=async_scheduling))
    spec, _ = run(engine, prompts, params)
    assert spec == plain
    assert counts.accepted > 0
    assert spec["r0"][2:] == ("stop", stop_string) and len(spec["r0"][0]) <= 7
    assert spec["r1"][2:] == ("stop", stop_token) and spec["r1"][0][-1] == stop_token
    assert spec["r2"][2] == "length" and len(spec["r2"][0]) == 7
    assert spec["r3"][1].endswith(stop_string)


def counted(engine: LLMEngine) -> tuple[LLMEngine, Counts]:
    """The engine, with a `Counts` among its stat loggers."""
    counts = Counts()
    engine.stat_loggers.append(counts)
    return engine, counts


@LOOPS
def test_seeded_sampling_and_undraftable_requests_in_one_batch(async_scheduling: bool) -> None:
    params = [SamplingParams(max_tokens=10, temperature=0.8, seed=i, ignore_eos=True)
              for i in range(4)]
    params += [SamplingParams(max_tokens=10, temperature=0.8, seed=9, presence_penalty=1.0,
                              ignore_eos=True),
               SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True),
               SamplingParams(max_tokens=10, temperature=0.0, min_tokens=6, ignore_eos=True)]
    plain, _ = run(make_engine(), PROMPTS, params)
    engine, counts = counted(spec_engine(async_scheduling=async_scheduling))
    spec, _ = run(engine, PROMPTS, params)
    assert spec == plain
    assert counts.accepted > 0


@LOOPS
def test_a_tight_pool_preempts_and_nothing_leaks(async_scheduling: bool) -> None:
    plain, _ = run(make_engine(num_blocks=18), PROMPTS, GREEDY)
    engine, counts = counted(spec_engine(num_blocks=18, async_scheduling=async_scheduling))
    spec, _ = run(engine, PROMPTS, GREEDY)
    assert engine.state.stats.num_preemptions > 0
    assert spec == plain
    assert counts.accepted > 0


@LOOPS
def test_nothing_compiles_after_warm_up(async_scheduling: bool) -> None:
    engine = spec_engine(precompile=True, debug_recompiles=True,
                         async_scheduling=async_scheduling)
    runner = engine.runner
    assert runner.request_buckets[-1] == 4 * (1 + 3)  # R * (1 + K) sampler rows
    params = [GREEDY, SamplingParams(max_tokens=9, temperature=1.0, top_k=5, seed=1,
                                     ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.5, repetition_penalty=1.3,
                             ignore_eos=True)]
    run(engine, PROMPTS, [params[i % 3] for i in range(len(PROMPTS))])
    assert runner.stats.compilations_after_warmup == 0  # debug_recompiles would have raised
    assert runner.stats.steps > 0


def test_accepted_rows_emit_the_targets_distribution() -> None:
    """The fake model puts logit 10 on one token (`fake_next_token` of the context) and 0 on
    the others, so at temperature T the target draws that token with probability
    q = e^(10/T) / (e^(10/T) + V - 1) and each other one with (1 - q) / (V - 1). Drafts are
    the greedy continuation, so each is accepted with probability q. A token emitted from a
    row after an accepted draft (a step's second token on) must still hit with probability q:
    emitting biased tokens there (the draft, or a greedy one) would raise the rate towards 1.
    Tolerance: 4.5 binomial standard deviations (a false alarm about once in 150 000 runs;
    the engine's seeds come from `EngineArgs.seed`, so the run is the same every time)."""
    T, max_tokens, n_requests = 2.5, 16, 64
    q = math.exp(LOGIT / T) / (math.exp(LOGIT / T) + V - 1)
    # The synchronous loop (verification is the same in both; there every step drafts).
    engine = spec_engine(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=400,
                         async_scheduling=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=T, ignore_eos=True)
    prompts = [[(7 * i + j) % V for j in range(3 + i % 5)] for i in range(n_requests)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    seen = {f"r{i}": 0 for i in range(n_requests)}
    hits = {"first": [0, 0], "after_accept": [0, 0]}  # [hits, tokens]
    offsets = [0] * 8  # misses by (token - target's token) mod V, in 8 bins of 12
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, prompt = out.outputs[0].token_ids, prompts[int(out.request_id[1:])]
            for i in range(seen[out.request_id], len(tokens)):
                if i == 0:
                    continue  # the prefill's token: no drafts were involved
                kind = "first" if i == seen[out.request_id] else "after_accept"
                want = fake_next_token([*prompt, *tokens[:i]], V)
                hits[kind][0] += tokens[i] == want
                hits[kind][1] += 1
                if tokens[i] != want:
                    offsets[((tokens[i] - want) % V - 1) // 12] += 1
            seen[out.request_id] = len(tokens)
    for kind, (hit, n) in hits.items():
        assert n > 300, kind
        assert abs(hit / n - q) <= 4.5 * math.sqrt(q * (1 - q) / n), (kind, hit / n, q)
    # Misses spread evenly over the other V - 1 tokens: chi-square over the 8 bins, 7 degrees
    # of freedom, below 29.88 (its 0.9999 quantile).
    expected = sum(offsets) / 8
    assert sum((o - expected) ** 2 / expected for o in offsets) < 29.88, offsets


def test_text_prompts_and_the_tokenizer() -> None:
    tok = FakeTokenizer()
    engine = spec_engine()
    engine.add_request("a", tok.decode([5, 6, 7]), GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and list(outs[-1].outputs[0].token_ids) == fake_greedy([5, 6, 7],
                                                                                    12, V)


@LOOPS
def test_a_tight_budget_schedules_part_of_the_drafts(async_scheduling: bool) -> None:
    # 8 tokens a step for 4 running requests that each want 1 + 3: the scheduler cuts drafts
    # (scheduled_spec_decode_tokens holds the part it took), and the verifier reads that part.
    plain, _ = run(make_engine(max_num_batched_tokens=8), PROMPTS, GREEDY)
    engine = spec_engine(max_num_batched_tokens=8, async_scheduling=async_scheduling)
    counts = Counts()
    engine.stat_loggers.append(counts)
    scheduled: list[int] = []
    record_scheduled_drafts(engine, scheduled)
    spec, _ = run(engine, PROMPTS, GREEDY)
    assert spec == plain
    assert any(n < 3 for n in scheduled) and counts.accepted == counts.draft_tokens > 0


@pytest.mark.slow  # 4-16 s; tests/jaxengine/engine/test_engine_config.py has the same rule fast
def test_a_scheduled_budget_below_the_runners_caps_every_step_drafts_included() -> None:
    """docs/SCHEDULING.md §2, "Two token budgets": the runner is compiled for 32 tokens a
    step, the scheduler hands out 10, drafts included; the outputs are the greedy ones."""
    engine = spec_engine(async_scheduling=False, max_num_scheduled_tokens=10)
    assert engine.runner.token_buckets[-1] == 32
    plans: list[Any] = []
    verify = engine.speculator.verify  # type: ignore[union-attr]

    def recording(plan: Any, rows: Any, tracked: Any) -> Any:
        plans.append(plan)
        return verify(plan, rows, tracked)

    engine.speculator.verify = recording  # type: ignore[union-attr,method-assign]
    spec, _ = run(engine, PROMPTS, GREEDY)
    for i, prompt in enumerate(PROMPTS):
        assert list(spec[f"r{i}"][0]) == fake_greedy(prompt, 12, V)
    assert max(p.total_num_scheduled_tokens for p in plans) == 10
    assert any(p.total_num_scheduled_tokens == 10 and p.scheduled_spec_decode_tokens
               for p in plans)


def record_scheduled_drafts(engine: LLMEngine, seen: list[int]) -> None:
    """Append to `seen` how many drafts each plan schedules per request (the speculator's
    `verify` gets every plan)."""
    verify = engine.speculator.verify  # type: ignore[union-attr]

    def recording(plan: Any, rows: Any, tracked: Any) -> Any:
        seen.extend(len(d) for d in plan.scheduled_spec_decode_tokens.values())
        return verify(plan, rows, tracked)

    engine.speculator.verify = recording  # type: ignore[union-attr,method-assign]


@LOOPS
def test_max_model_len_and_aborts_with_drafts_in_flight(async_scheduling: bool) -> None:
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    plain, _ = run(make_engine(max_model_len=24), PROMPTS[:1] + PROMPTS[2:4], params)
    spec, _ = run(spec_engine(max_model_len=24, async_scheduling=async_scheduling),
                  PROMPTS[:1] + PROMPTS[2:4], params)
    assert spec == plain
    assert all(len(PROMPTS[i]) + len(spec[f"r{j}"][0]) == 24
               for j, i in enumerate((0, 2, 3)))
    engine = spec_engine(async_scheduling=async_scheduling)
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY)
    for _ in range(4):
        engine.step()  # the drafts of the next step are in the scheduler's state now
    assert any(r.spec_token_ids for r in engine.state.requests.values())
    engine.abort_request(["r0", "r1"])
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    check_invariants(engine.state)
    assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1
    assert {o.request_id for o in outs} == {"r2"}  # nothing stale of the aborted ones
    assert list(outs[-1].outputs[0].token_ids) == fake_greedy(PROMPTS[2], 12, V)
