"""Prompt logprobs through the engine (vLLM's `SamplingParams.prompt_logprobs`).

On the fake model every value can be computed by hand: its logits are `LOGIT` at
`fake_next_token(prefix)` and 0 elsewhere, so a prompt token's raw logprob is
`LOGIT - log(e^LOGIT + V - 1)` (rank 1) when it is the model's next token and
`-log(e^LOGIT + V - 1)` (rank 2) otherwise. Checked in one chunk and chunked, sync and async,
through preemption (no position recorded twice), with speculative decoding's drafts, and
prefix caching (nothing read from it);
against `jaxengine.score` on a tiny checkpoint; and with zero compilations after warm-up.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.engine.outputs import RequestOutput
from jaxengine.model.fake import LOGIT, fake_next_token
from scheduler import SamplingParams, SamplingParamsError
from tests.jaxengine.engine.test_llm_engine import PROMPTS, V, make_engine, run_all

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny" / "llama_tied_mha"
NORM = math.log(math.exp(LOGIT) + V - 1)


def _run(prompts: list[list[int]], params: SamplingParams, **kw) -> tuple[dict, object]:
    engine = make_engine(**kw)
    return run_all(engine, prompts, params), engine


def _expected(prompt: list[int], k: int) -> list[dict[int, tuple[float, int]] | None]:
    """The fake model's prompt logprobs: {token: (logprob, rank)} per position, by hand."""
    out: list[dict[int, tuple[float, int]] | None] = [None]
    for j in range(1, len(prompt)):
        best = fake_next_token(prompt[:j], V)
        hit = prompt[j] == best
        out.append({prompt[j]: (LOGIT - NORM if hit else -NORM, 1 if hit else 2)})
    return out


def _as_plain(plp: list) -> list:
    return [None if e is None else {t: (round(lp.logprob, 4), lp.rank) for t, lp in e.items()}
            for e in plp]


def _check_fake(out: RequestOutput, prompt: list[int], k: int) -> None:
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    expected = _expected(prompt, k)
    for j in range(1, len(prompt)):
        entry = plp[j]
        assert len(entry) in (k, k + 1)  # the top k, and the prompt token if not among them
        token = entry[prompt[j]]
        want_lp, want_rank = expected[j][prompt[j]]
        assert token.logprob == pytest.approx(want_lp, abs=1e-4) and token.rank == want_rank
        if k:  # the best is the model's next token, rank 1
            best = next(t for t, lp in entry.items() if lp.rank == 1)
            assert best == fake_next_token(prompt[:j], V)
            assert entry[best].logprob == pytest.approx(LOGIT - NORM, abs=1e-4)
        assert token.decoded_token == chr(0x100 + prompt[j])


NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 8}, {"async_scheduling": True},
                                {"num_blocks": 18}, {"speculative_config": NGRAM}],
                         ids=["one-chunk", "chunked", "async", "preempting", "speculative"])
def test_prompt_logprobs_are_the_fake_models_by_hand(kw: dict) -> None:
    # Prompts that follow the model (rank 1) for a while, then break from it.
    follow = [7, 8]
    for _ in range(10):
        follow.append(fake_next_token(follow, V))
    prompts = [*PROMPTS, follow + [1, 2, 3]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    done, engine = _run(prompts, params, **kw)
    if "num_blocks" in kw:
        assert engine.state.stats.num_preemptions > 0  # recomputed prompts: no duplicates
    for i, p in enumerate(prompts):
        _check_fake(done[f"r{i}"], p, 2)
    assert [lp.rank for lp in (e[t] for e, t in zip(done["r7"].prompt_logprobs[3:12],
                                                      follow[3:12], strict=True))] == [1] * 9


def test_chunked_and_async_give_the_same_prompt_logprobs_as_one_chunk() -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    one, _ = _run(PROMPTS, params)
    for kw in ({"max_num_batched_tokens": 8}, {"max_num_batched_tokens": 8,
                                               "async_scheduling": True}):
        other, _ = _run(PROMPTS, params, **kw)
        for rid, out in one.items():
            assert _as_plain(other[rid].prompt_logprobs) == _as_plain(out.prompt_logprobs)
            assert other[rid].outputs[0].token_ids == out.outputs[0].token_ids


def test_a_cached_prompt_still_gets_every_position() -> None:
    engine = make_engine()
    prompt = list(range(1, 42))
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request("warm", {"prompt_token_ids": prompt}, greedy)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("hit", {"prompt_token_ids": prompt}, greedy)
    engine.add_request("asks", {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["hit"].num_cached_tokens == 40 and outs["hit"].prompt_logprobs is None
    assert outs["asks"].num_cached_tokens == 0
    _check_fake(outs["asks"], prompt, 0)


def test_prompt_logprobs_above_max_logprobs_are_refused_by_name() -> None:
    engine = make_engine(max_logprobs=3)
    with pytest.raises(SamplingParamsError, match="max_logprobs=3") as e:
        engine.add_request("a", [1, 2, 3], SamplingParams(prompt_logprobs=4))
    assert e.value.param == "prompt_logprobs"
    assert not engine.has_unfinished_requests()


def test_real_model_prompt_logprobs_equal_score_and_compile_nothing_new() -> None:
    from jaxengine.fixed_batch.model import model_fns_of
    from jaxengine.fixed_batch.score import score
    from jaxengine.llm import LLM

    llm = LLM(str(TINY), max_num_batched_tokens=16, max_num_seqs=4, block_size=4,
              max_model_len=64, num_gpu_blocks_override=60, debug_recompiles=True)
    runner = llm.llm_engine.runner
    runner.wait_for_programs()  # LLM() leaves the buckets a first request does not need
    programs = runner.stats.compilations
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 100, 37)]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=5)
    out = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt[:9]}],
                       params, use_tqdm=False)
    assert runner.stats.compilations == programs and runner.stats.compilations_after_warmup == 0
    fns, _ = model_fns_of(llm)
    ref = np.asarray(score(fns, jnp.asarray([prompt[:1]]), jnp.asarray([prompt[1:]])).logprobs[0])
    plp = out[0].prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    got = np.array([plp[j][prompt[j]].logprob for j in range(1, len(prompt))])
    np.testing.assert_allclose(got, ref, atol=1e-4)  # chunked (16 a step) against one forward
    for j in range(1, len(prompt)):
        tops = sorted((lp.rank, lp.logprob) for lp in plp[j].values() if lp.rank <= 5)
        assert [r for r, _ in tops][:5] == [1, 2, 3, 4, 5]
        assert all(a[1] >= b[1] for a, b in zip(tops, tops[1:], strict=False))
        mine = plp[j][prompt[j]]
        if mine.rank > 5:  # below the top 5: every one of them is more likely
            assert all(lp > mine.logprob for _, lp in tops)
        else:
            assert tops[mine.rank - 1][1] == pytest.approx(mine.logprob, abs=1e-6)
    np.testing.assert_allclose([plp[j][prompt[j]].logprob for j in range(1, 9)],
                               [e[prompt[j]].logprob
                                for j, e in enumerate(out[1].prompt_logprobs) if j],
                               atol=1e-4)
