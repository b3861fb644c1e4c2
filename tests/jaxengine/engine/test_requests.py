"""Engine request handling: bad input, stop strings and ids, min_tokens, logprobs, abort."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from jaxengine.engine.args import EngineArgs
from jaxengine.llm import LLM
from jaxengine.model.fake import fake_greedy, fake_model
from scheduler import RequestOutputKind, SamplingParams, SamplingParamsError
from tests.engine_helpers import engine_over
from tests.jaxengine.engine.test_llm_engine import EOS, FakeTokenizer, V, make_engine, run_all

P = [5, 6, 7, 8]
EXPECTED = fake_greedy(P, 20, V)
TOK = FakeTokenizer()


def _one(params: SamplingParams, **kw: Any) -> Any:
    return run_all(make_engine(**kw), [P], params)["r0"]


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ({"prompt_token_ids": []}, SamplingParams(), "empty"),
        ({"prompt_token_ids": list(range(64))}, SamplingParams(), "max_model_len"),
        ({"prompt_token_ids": [1, 2.5]}, SamplingParams(), "ints"),
        ({"prompt_token_ids": [1, V]}, SamplingParams(), "ints in"),
        ({"prompt_ids": [1]}, SamplingParams(), "prompt_token_ids"),
        ("a\ud800b", SamplingParams(), "lone surrogate"),
        ({"prompt_token_ids": [1]}, SamplingParams(logprobs=99), "logprobs"),
        ({"prompt_token_ids": [1]}, SamplingParams(stop_token_ids=[V]), "vocab_size=97"),
        ({"prompt_token_ids": [1]}, SamplingParams(min_tokens=1, stop_token_ids=range(8)),
         "at most 7 stop_token_ids"),
        ({"prompt_token_ids": [1] * 30}, SamplingParams(max_tokens=40), "never fit"),
    ],
)
def test_bad_requests_raise_and_the_engine_keeps_serving(prompt: Any, params: SamplingParams,
                                                         message: str) -> None:
    # Parameters that are bad on their own never get this far: SamplingParams refuses them
    # when built (tests/scheduler/test_sampling_params.py); these need the engine.
    engine = make_engine(max_model_len=64, num_blocks=12)
    llm = LLM.from_engine(engine)
    good = {"prompt_token_ids": P}
    with pytest.raises(ValueError, match=message):
        llm.generate([good, prompt], [SamplingParams(max_tokens=3)] + [params],
                     use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.state.num_free_blocks == 11
    out = llm.generate(good, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == EXPECTED[:3]


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(logprobs=21), "logprobs"),  # EngineArgs.max_logprobs is 20
        (SamplingParams(stop_token_ids=[3, V]), "stop_token_ids"),
        (SamplingParams(min_tokens=2, stop_token_ids=range(8)), "stop_token_ids"),
    ],
)
def test_what_only_the_engine_can_check_names_the_param(params: SamplingParams,
                                                        param: str) -> None:
    engine = make_engine()
    with pytest.raises(SamplingParamsError) as info:
        engine.add_request("a", {"prompt_token_ids": P}, params)
    assert info.value.param == param
    assert not engine.has_unfinished_requests() and not engine.snapshot().requests
    engine.add_request("a", {"prompt_token_ids": P}, SamplingParams(logprobs=20,
                                                                    stop_token_ids=[V - 1]))


def test_stop_strings_without_a_tokenizer_name_stop() -> None:
    engine = engine_over(fake_model(V), EngineArgs(max_num_batched_tokens=32, max_num_seqs=4,
                                                   block_size=4),
                         tokenizer=None, max_model_len=64, num_blocks=40)
    with pytest.raises(SamplingParamsError, match="stop_token_ids instead") as info:
        engine.add_request("a", {"prompt_token_ids": P}, SamplingParams(stop=["x"]))
    assert info.value.param == "stop"


def test_params_that_are_not_sampling_params_are_refused() -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="params must be a SamplingParams, got dict"):
        engine.add_request("a", {"prompt_token_ids": P}, {"temperature": 0.0})  # type: ignore[arg-type]
    assert not engine.snapshot().requests


def test_unknown_engine_argument_is_named() -> None:
    with pytest.raises(ValueError, match=r"'max_num_seq' \(did you mean 'max_num_seqs'\?\)"):
        EngineArgs.from_kwargs(max_num_seq=4)
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineArgs(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineArgs(gpu_memory_utilization=0.0)


def test_duplicate_request_id_is_rejected() -> None:
    engine = make_engine()
    engine.add_request("a", {"prompt_token_ids": P})
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", {"prompt_token_ids": P})


def test_stop_string_trims_text_and_frees_blocks() -> None:
    stop = TOK.decode(EXPECTED[3:5])  # spans two tokens
    out = _one(SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop]))
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == TOK.decode(EXPECTED[:3])
    assert list(c.token_ids) == EXPECTED[:5]  # token ids are not trimmed (as vLLM)


def test_include_stop_str_in_output_keeps_the_stop_string() -> None:
    stop = TOK.decode(EXPECTED[3:5])
    out = _one(SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop],
                              include_stop_str_in_output=True))
    assert out.outputs[0].text == TOK.decode(EXPECTED[:5])


def test_skip_special_tokens_false_keeps_eos_in_the_text() -> None:
    prompt = next(p for p in ([i, j] for i in range(V) for j in range(V))
                  if fake_greedy(p, 1, V) == [EOS])
    texts = {}
    for skip in (True, False):  # EOS is not the last token, so it is decoded (as vLLM)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                skip_special_tokens=skip)
        c = run_all(make_engine(), [prompt], params)["r0"].outputs[0]
        assert c.token_ids[0] == EOS
        texts[skip] = c.text
    assert texts[False] == TOK.decode(c.token_ids, skip_special_tokens=False)
    assert texts[True] == TOK.decode(c.token_ids) != texts[False]


def test_stop_token_id_ends_the_request_and_is_not_in_the_text() -> None:
    stop_id = EXPECTED[6]
    first = EXPECTED.index(stop_id)
    c = _one(SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_id])).outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id
    assert list(c.token_ids) == EXPECTED[: first + 1]
    assert c.text == TOK.decode(EXPECTED[:first])


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    stop_id = EXPECTED[0]
    params = SamplingParams(max_tokens=6, min_tokens=3, temperature=0.0,
                            stop_token_ids=[stop_id])
    c = _one(params).outputs[0]
    assert stop_id not in c.token_ids[:3]
    assert len(c.token_ids) >= 3


def test_eos_stops_unless_ignored() -> None:
    engine = make_engine()
    prompt = next(p for p in ([i, j] for i in range(V) for j in range(V))
                  if fake_greedy(p, 1, V) == [EOS])
    out = run_all(engine, [prompt], SamplingParams(max_tokens=5, temperature=0.0))["r0"]
    assert out.outputs[0].finish_reason == "stop" and list(out.outputs[0].token_ids) == [EOS]
    assert out.outputs[0].stop_reason is None and out.outputs[0].text == ""


def test_logprobs_of_the_fake_model() -> None:
    c = _one(SamplingParams(max_tokens=4, temperature=0.0, logprobs=2)).outputs[0]
    assert len(c.logprobs) == 4
    for token, entry in zip(c.token_ids, c.logprobs, strict=True):
        best = entry[token]
        assert best.rank == 1 and best.logprob == pytest.approx(-0.0043, abs=1e-3)
        assert len(entry) == 2
        assert best.decoded_token == TOK.decode([token])
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in
                                                     zip(c.token_ids, c.logprobs, strict=True)))
    assert _one(SamplingParams(max_tokens=2, temperature=0.0)).outputs[0].logprobs is None


def test_a_sampled_token_outside_the_top_list_has_its_rank() -> None:
    # logit_bias forces token 5, which the fake model ranks second (its next token has LOGIT,
    # every other 0): with logprobs=0 the entry holds only the sampled token, rank and all,
    # as vLLM's does.
    c = _one(SamplingParams(max_tokens=3, temperature=0.0, logprobs=0,
                            logit_bias={5: 100.0})).outputs[0]
    assert list(c.token_ids) == [5, 5, 5]
    assert [list(e) for e in c.logprobs] == [[5]] * 3
    assert [e[5].rank for e in c.logprobs] == [2, 2, 2]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_frees_blocks_and_others_finish(async_scheduling: bool) -> None:
    engine = make_engine(async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": P}, params)
    engine.add_request("b", {"prompt_token_ids": [1, 2, 3]}, params)
    engine.step()
    engine.step()
    snapshot = engine.snapshot()
    (aborted,) = engine.abort_request("a")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    # What two steps drew; the async loop has taken in one of them (the other was in flight).
    drawn = 1 if async_scheduling else 2
    assert list(aborted.outputs[0].token_ids) == fake_greedy(P, drawn, V)
    assert aborted.metrics.finished_time is not None
    assert engine.abort_request("a") == []  # already gone: nothing to report twice
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(done) == {"b"}
    assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1
    assert set(snapshot.requests) == {"a", "b"}  # an old state stays valid


def test_debug_recompiles_env_var_turns_the_guard_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXENGINE_DEBUG_RECOMPILES", "1")
    assert make_engine().runner.config.debug_recompiles
    monkeypatch.setenv("JAXENGINE_DEBUG_RECOMPILES", "0")
    assert not make_engine().runner.config.debug_recompiles


def test_research_policies_are_engine_choices() -> None:
    assert EngineArgs(scheduling_policy="srpf").scheduling_policy == "srpf"
    with pytest.raises(ValueError, match="fcfs, priority, srpf"):
        EngineArgs(scheduling_policy="lifo")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_final_only_requests_get_just_their_final_output(async_scheduling: bool) -> None:
    # The same two requests run once with every output and once final-only (for "b" only):
    # "b"'s one output is the cumulative run's last, and "a" still gets one per step.
    # (Compared without their metrics: the two runs' clocks differ.)
    def run(kind: RequestOutputKind) -> dict[str, list[Any]]:
        engine = make_engine(async_scheduling=async_scheduling)
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        engine.add_request("a", {"prompt_token_ids": P}, params)
        engine.add_request("b", {"prompt_token_ids": [1, 2, 3]},
                           dataclasses.replace(params, max_tokens=7, output_kind=kind))
        outputs: dict[str, list[Any]] = {"a": [], "b": []}
        while engine.has_unfinished_requests():
            for o in engine.step():
                outputs[o.request_id].append((o.finished, o.outputs, o.prompt_token_ids))
        return outputs

    every, final = run(RequestOutputKind.CUMULATIVE), run(RequestOutputKind.FINAL_ONLY)
    assert len(every["b"]) == 7 and len(final["b"]) == 1
    assert final["b"][0][0] and final["b"][0] == every["b"][-1]
    assert final["a"] == every["a"] and len(final["a"]) == 5
