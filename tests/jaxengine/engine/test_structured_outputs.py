"""Structured outputs in the engine: grammars compile while the request waits (WAITING_FOR_FSM),
the runner's bitmask constrains every sampled token, a finished grammar stops the request, async
scheduling gives the synchronous loop's outputs, and nothing compiles after warm-up.

On the tiny fixture model (random weights) with its real character-level tokenizer: the
outputs are random but must satisfy their constraints (checked with Python's `re` and json).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import build_engine
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.model.fake import fake_model
from jaxengine.structured import StructuredOutputsError, StructuredOutputsParams
from scheduler import SamplingParams, SamplingParamsError, check_invariants
from tests.engine_helpers import engine_over
from tests.jaxengine.engine.test_llm_engine import V

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny" / "llama_tied_mha"
NO_SPACE = {4: -100.0, 99: -100.0}  # " " and "\n": flexible JSON whitespace would pad forever
REGEX = r"[ab]{2,5}c[0-9]"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
          "required": ["n"], "additionalProperties": False}


def _engine(**kw: Any) -> LLMEngine:
    args = dict(model=str(TINY), max_num_batched_tokens=32, max_num_seqs=4, block_size=4,
                max_model_len=128, num_gpu_blocks_override=200)
    return build_engine(EngineArgs(**{**args, **kw}))


def _requests() -> list[tuple[str, str, SamplingParams]]:
    so = StructuredOutputsParams
    return [
        ("json", "a", SamplingParams(max_tokens=40, seed=1, logit_bias=NO_SPACE,
                                     structured_outputs=so(json=SCHEMA))),
        ("regex", "bb", SamplingParams(max_tokens=20, seed=2, structured_outputs=so(regex=REGEX))),
        ("greedy", "c", SamplingParams(max_tokens=20, temperature=0.0,
                                       structured_outputs=so(regex=REGEX))),
        ("choice", "dd", SamplingParams(max_tokens=20, seed=3, presence_penalty=1.0,
                                        structured_outputs=so(choice=["left", "right"]))),
        ("plain", "e", SamplingParams(max_tokens=12, seed=4, ignore_eos=True)),
        ("plain2", "ff", SamplingParams(max_tokens=30, seed=5, ignore_eos=True)),
    ]


def _run(engine: LLMEngine) -> dict[str, tuple]:
    for rid, prompt, params in _requests():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.text, tuple(c.token_ids), c.finish_reason)
        check_invariants(engine.state)
    assert engine.step() == []  # async: nothing left in flight
    assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1
    return done


def _check(done: dict[str, tuple]) -> None:
    assert set(done) == {r for r, _, _ in _requests()}
    for rid in ("json", "regex", "greedy", "choice"):
        assert done[rid][2] == "stop", done[rid]  # the grammar ended: EOS, as vLLM
    assert json.loads(done["json"][0])["n"] in range(100)
    assert re.fullmatch(REGEX, done["regex"][0]) and re.fullmatch(REGEX, done["greedy"][0])
    assert done["choice"][0] in ("left", "right")
    assert len(done["plain"][1]) == 12 and len(done["plain2"][1]) == 30


def test_async_gives_the_sync_outputs_with_grammars_and_nothing_compiles_after_warmup(
) -> None:
    sync = _engine(async_scheduling=False, precompile=True, debug_recompiles=True)
    out_sync = _run(sync)
    _check(out_sync)
    asyn = _engine(async_scheduling=True, precompile=True, debug_recompiles=True)
    assert _run(asyn) == out_sync
    for e in (sync, asyn):  # debug_recompiles would have raised; the counter says so too
        assert e.runner.stats.compilations_after_warmup == 0


def test_preempted_grammar_requests_resume_where_they_were() -> None:
    # 11 usable blocks of 4 tokens for about 60 tokens of work: requests are preempted
    # (recomputed) mid-grammar; their matchers keep their place, in both loops.
    tight = dict(num_gpu_blocks_override=12, max_num_seqs=6, max_model_len=40)
    sync = _engine(async_scheduling=False, **tight)
    out_sync = _run(sync)
    _check(out_sync)
    asyn = _engine(async_scheduling=True, **tight)
    assert _run(asyn) == out_sync
    assert sync.state.stats.num_preemptions + asyn.state.stats.num_preemptions > 0


def test_a_request_waits_for_its_grammar_and_others_run_meanwhile() -> None:
    engine = _engine(async_scheduling=False)
    slow: Future = Future()  # a compilation that has not finished
    compiler = engine.grammar_compiler
    real_submit = compiler.submit
    compiler.submit = lambda params: slow  # type: ignore[method-assign]
    engine.add_request("g", "x", SamplingParams(
        max_tokens=10, seed=0, structured_outputs=StructuredOutputsParams(regex="(ab)+!")))
    engine.add_request("p", "y", SamplingParams(max_tokens=3, seed=0, ignore_eos=True))
    for _ in range(3):
        outs = engine.step()
        assert {o.request_id for o in outs} == {"p"}  # g waits as WAITING_FOR_FSM
    slow.set_result(real_submit(StructuredOutputsParams(regex="(ab)+!")).result())
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert re.fullmatch("(ab)+!", done["g"].outputs[0].text)


def test_a_grammar_that_fails_to_compile_aborts_its_request() -> None:
    engine = _engine(async_scheduling=True)
    failed: Future = Future()
    failed.set_exception(StructuredOutputsError("structured_outputs.regex: does not compile",
                                                param="structured_outputs.regex"))
    engine.grammar_compiler.submit = lambda params: failed  # type: ignore[method-assign]
    engine.add_request("bad", "x", SamplingParams(
        structured_outputs=StructuredOutputsParams(regex="a")))
    (out,) = engine.step()
    assert out.request_id == "bad" and out.finished
    assert out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()


def test_structured_outputs_need_the_models_tokenizer() -> None:
    engine = engine_over(fake_model(V), EngineArgs(max_num_batched_tokens=32, max_num_seqs=4,
                                                   block_size=4),
                         tokenizer=None, max_model_len=64, num_blocks=50)  # skip_tokenizer_init
    with pytest.raises(SamplingParamsError, match="need the model's tokenizer") as e:
        engine.add_request("r", [1, 2], SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="a")))
    assert e.value.param == "structured_outputs"
    with pytest.raises(SamplingParamsError, match="StructuredOutputsParams"):
        _engine().add_request("r", "x", SamplingParams(structured_outputs={"regex": "a"}))


@pytest.mark.slow
def test_the_default_model_answers_in_json_under_a_schema() -> None:
    from jaxengine.llm import LLM

    llm = LLM(max_num_batched_tokens=256, max_num_seqs=4, max_model_len=512,
              num_gpu_blocks_override=128)  # SmolLM2, its byte-level BPE tokenizer
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "number", "minimum": 0, "maximum": 50}},
        "required": ["city", "population_millions"], "additionalProperties": False}
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    out = llm.chat(messages, SamplingParams(max_tokens=60, temperature=0.0,
                                            structured_outputs=so), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop", c.text
    answer = json.loads(c.text)
    assert set(answer) == {"city", "population_millions"} and "Paris" in answer["city"]
