"""Prompt-lookup speculation on a tiny random Llama (real attention over drafted positions):
greedy and seeded outputs are those without speculation, in the synchronous loop and under
async scheduling, and repetitive text accepts drafts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import build_engine
from scheduler import SamplingParams
from tests.jaxengine.spec.test_spec_engine import LOOPS, NGRAM, Counts
from tests.jaxengine.spec.test_spec_engine import run as run_engine

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny" / "llama3_gqa"
PROMPTS = ["abcabcabcabc", "hello hello hello", "xyz", "1 2 3 1 2 3 1 2"]


def run(params: SamplingParams, **kw: Any) -> tuple[dict[str, tuple], Counts, int]:
    engine = build_engine(EngineArgs(
        model=str(TINY), max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4,
        block_size=4, num_gpu_blocks_override=200, attention_backend="reference", **kw))
    counts = Counts()
    engine.stat_loggers.append(counts)
    done, steps = run_engine(engine, PROMPTS, params)
    return done, counts, steps


@LOOPS
def test_greedy_outputs_are_unchanged_and_drafts_are_accepted(async_scheduling: bool) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, _, plain_steps = run(params, async_scheduling=False)
    spec, counts, spec_steps = run(params, speculative_config=NGRAM,
                                   async_scheduling=async_scheduling)
    assert spec == plain
    assert 0 < counts.accepted < counts.draft_tokens
    if not async_scheduling:  # async: each verifying step costs the request the next one,
        assert spec_steps < plain_steps  # more than these partly accepted drafts save


@pytest.mark.slow  # 24 s: two engines; test_draft_model.py drafts over an fp8 cache by default
def test_greedy_outputs_over_an_fp8_cache_are_unchanged() -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, _, _ = run(params, kv_cache_dtype="fp8")
    spec, counts, _ = run(params, kv_cache_dtype="fp8", speculative_config=NGRAM)
    assert spec == plain
    assert 0 < counts.accepted < counts.draft_tokens


@LOOPS
def test_seeded_sampling_is_unchanged(async_scheduling: bool) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.3, top_k=20, seed=7, ignore_eos=True)
    plain, _, _ = run(params, async_scheduling=False)
    spec, counts, _ = run(params, speculative_config=NGRAM, async_scheduling=async_scheduling)
    assert spec == plain
    assert counts.accepted > 0  # low temperature on repetitive prompts: some drafts hold


def test_llm_takes_the_dict() -> None:
    from jaxengine.llm import LLM

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain, _, _ = run(params)
    llm = LLM(model=str(TINY), max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4,
              block_size=4, num_gpu_blocks_override=200, attention_backend="reference",
              precompile=False, speculative_config=NGRAM)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [tuple(o.outputs[0].token_ids) for o in outs] == [plain[f"r{i}"][0]
                                                             for i in range(len(PROMPTS))]
    assert llm.llm_engine.args.async_scheduling is True  # the default, kept with drafts


@pytest.mark.slow  # 22 s: two engines; test_verify.py keeps grammar requests undrafted
def test_a_grammar_request_beside_drafted_ones() -> None:
    import re

    from jaxengine.structured.params import StructuredOutputsParams

    regex = r"[ab]{2,5}c[0-9]"

    def outputs(**kw: Any) -> dict[str, tuple]:
        engine = build_engine(EngineArgs(
            model=str(TINY.parent / "llama_tied_mha"), max_num_batched_tokens=32,
            max_num_seqs=4, block_size=4, max_model_len=128, num_gpu_blocks_override=200,
            attention_backend="reference", **kw))
        engine.add_request("g", "a", SamplingParams(
            max_tokens=20, seed=1, structured_outputs=StructuredOutputsParams(regex=regex)))
        engine.add_request("p", "abcabcabc", SamplingParams(max_tokens=20, temperature=0.0,
                                                            ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = (out.outputs[0].text, out.outputs[0].token_ids)
        assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1
        return done

    spec = outputs(speculative_config=NGRAM)
    assert spec == outputs()
    assert re.fullmatch(regex, spec["g"][0])
