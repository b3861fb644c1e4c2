"""`jaxengine.streaming` over the fake model: the pieces are the final text, streamed early."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from jaxengine.llm import LLM
from jaxengine.model.fake import fake_greedy
from jaxengine.replicas.data_parallel import DataParallelEngine
from jaxengine.streaming import TextDelta, in_prompt_order, stream, stream_chat
from scheduler import SamplingParams
from tests.jaxengine.engine.test_llm_engine import PROMPTS, FakeTokenizer, V, make_engine
from tests.jaxengine.test_llm import _llm

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
TOK = FakeTokenizer()


def _pieces(deltas: list[TextDelta]) -> dict[int, list[str]]:
    by_index: dict[int, list[str]] = defaultdict(list)
    for d in deltas:
        by_index[d.index].append(d.text)
    return by_index


def _llm_over(**kw: Any) -> LLM:
    return LLM.from_engine(make_engine(**kw))


def _text(prompt: list[int], params: SamplingParams) -> str:
    outs = _llm_over().generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return outs[0].outputs[0].text


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pieces_concatenate_to_the_final_text_and_come_before_the_finish(
        async_scheduling: bool) -> None:
    llm = _llm_over(async_scheduling=async_scheduling)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with stream(llm, prompts, GREEDY) as pieces:
        deltas = list(pieces)
    finals = {d.index: d.output for d in deltas if d.finished}
    assert sorted(finals) == list(range(len(PROMPTS)))
    for i, p in enumerate(PROMPTS):
        mine = [d for d in deltas if d.index == i]
        assert [d.finished for d in mine] == [False] * (len(mine) - 1) + [True]
        assert "".join(d.text for d in mine) == finals[i].outputs[0].text
        assert finals[i].outputs[0].text == TOK.decode(fake_greedy(p, 12, V))
        assert len(mine) > 1 and all(d.text for d in mine[:-1])  # one piece per token here
        assert mine[0].output.outputs[0].token_ids == tuple(fake_greedy(p, 12, V)[:1])
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_stop_string_is_never_streamed() -> None:
    prompt = PROMPTS[0]
    out = TOK.decode(fake_greedy(prompt, 12, V))
    stop = out[5:7]  # two tokens' text: the detokenizer holds one character back meanwhile
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])
    with stream(_llm_over(), [{"prompt_token_ids": prompt}], params) as pieces:
        deltas = list(pieces)
    streamed = "".join(d.text for d in deltas)
    assert streamed == out[: out.index(stop)] == _text(prompt, params)
    assert deltas[-1].output.outputs[0].stop_reason == stop
    assert len(deltas) > 2 and stop[0] not in streamed


def test_a_stop_token_and_min_tokens_stream_the_final_text() -> None:
    prompt = PROMPTS[4]
    ids = fake_greedy(prompt, 12, V)  # no EOS (96) among them, no repeats
    by_token = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[ids[4]])
    # min_tokens: the stop string of tokens 2-3 comes too early to count
    too_early = SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6,
                               stop=[TOK.decode(ids[2:4])])
    # pieces: one a token, then the finish ("": the stop token shows no text); with a stop
    # string of 2 the first token's text is held back and comes with the second, and so on
    cases = ((by_token, ids[:4], ids[4], 5), (too_early, ids, None, 11))
    for params, want, reason, num_pieces in cases:
        with stream(_llm_over(), [{"prompt_token_ids": prompt}], params) as pieces:
            deltas = list(pieces)
        final = deltas[-1].output.outputs[0]
        assert "".join(d.text for d in deltas) == final.text == _text(prompt, params)
        assert final.text == TOK.decode(want) and final.stop_reason == reason
        assert len(deltas) == num_pieces


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_close_aborts_what_is_left_and_frees_the_blocks(async_scheduling: bool) -> None:
    llm = _llm_over(async_scheduling=async_scheduling)
    engine = llm.llm_engine
    pieces = stream(llm, [{"prompt_token_ids": p} for p in PROMPTS[:3]], GREEDY)
    first = next(pieces)
    assert not first.finished and engine.get_num_unfinished_requests() == 3
    aborted = pieces.close()
    assert sorted(o.request_id for o in aborted) == sorted(pieces.request_ids)
    assert {o.outputs[0].finish_reason for o in aborted} == {"abort"}
    assert not engine.has_unfinished_requests() and not pieces.live
    assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1
    assert list(pieces) == [] and pieces.close() == []
    again = stream(llm, [{"prompt_token_ids": PROMPTS[0]}], GREEDY)  # the engine goes on
    assert "".join(d.text for d in again) == TOK.decode(fake_greedy(PROMPTS[0], 12, V))


def test_an_interrupted_step_aborts_the_streams_requests() -> None:
    llm = _llm_over()
    engine, real_step, calls = llm.llm_engine, llm.llm_engine.step, []

    def step() -> list[Any]:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    engine.step = step  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        list(stream(llm, [{"prompt_token_ids": PROMPTS[0]}], GREEDY))
    assert not engine.has_unfinished_requests()


def test_a_bad_prompt_adds_nothing() -> None:
    llm = _llm_over()
    with pytest.raises(ValueError, match="prompt_token_ids"):
        stream(llm, [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [V + 5]}], GREEDY)
    with pytest.raises(ValueError, match="one per prompt"):
        stream(llm, ["ab", "cd"], [GREEDY] * 3)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_stream_that_another_caller_emptied_says_so() -> None:
    llm = _llm_over()
    pieces = stream(llm, [{"prompt_token_ids": PROMPTS[0]}], GREEDY)
    llm.llm_engine.abort_request(pieces.request_ids)
    with pytest.raises(RuntimeError, match="left the engine unseen"):
        next(pieces)


def test_in_prompt_order_gives_whole_texts_in_order_the_first_live() -> None:
    prompts, lengths = [list(range(1, 40)), [5, 6, 7], [9] * 13], [12, 3, 3]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    with stream(_llm_over(), [{"prompt_token_ids": p} for p in prompts], params) as pieces:
        raw = list(pieces)
    assert [d.index for d in raw if d.finished] == [1, 2, 0]  # the engine's finishing order
    ordered = list(in_prompt_order(raw))
    assert [d.index for d in ordered] == sorted(d.index for d in ordered)
    texts = [TOK.decode(fake_greedy(p, n, V)) for p, n in zip(prompts, lengths, strict=True)]
    assert "".join(d.text for d in ordered) == "".join(texts)
    assert [d.output.outputs[0].text for d in ordered if d.finished] == texts
    assert len(_pieces(ordered)[0]) == 12  # prompt 0 stays live: one piece per token
    assert len(_pieces(ordered)[1]) == len(_pieces(ordered)[2]) == 1  # done meanwhile: whole


def test_stream_chat_renders_the_conversation_as_llm_chat_does() -> None:
    conv = [{"role": "user", "content": TOK.decode([10, 11])}]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with stream_chat(_llm(), conv, params) as pieces:
        deltas = list(pieces)
    want = _llm().chat(conv, params, use_tqdm=False)[0]
    got = deltas[-1].output
    assert got.prompt_token_ids == want.prompt_token_ids == [1, 10, 11, 2]
    assert got.prompt == want.prompt
    assert "".join(d.text for d in deltas) == want.outputs[0].text != ""


def test_a_data_parallel_engine_streams_and_aborts_alike() -> None:
    dp = DataParallelEngine([make_engine(), make_engine()])
    llm = LLM.from_engine(dp)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    with stream(llm, prompts, GREEDY) as pieces:
        assert {dp.replica_of(r) for r in pieces.request_ids} == {0, 1}
        texts = ["".join(d.text for d in in_prompt_order(pieces))]
    assert texts[0] == "".join(TOK.decode(fake_greedy(p, 12, V)) for p in PROMPTS[:4])
    with stream(llm, prompts, GREEDY) as pieces:
        next(pieces)
    assert not dp.has_unfinished_requests()
    assert all(r.state.num_free_blocks == r.scheduler_config.num_blocks - 1 for r in dp.replicas)
