"""`SamplingParams(n=...)` offline: the engine fans a request into n samples sharing the prompt
and merges their outputs under its id (jaxengine/engine/parallel_sampling.py), over the fake
model."""

from __future__ import annotations

import pytest

from jaxengine import LLM, stream
from jaxengine.engine.args import EngineArgs
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine.parallel_sampling import child_params
from jaxengine.model.fake import fake_greedy, fake_model
from scheduler import RequestOutputKind, SamplingParams, SamplingParamsError, check_invariants
from tests.engine_helpers import engine_over

V = 97
PROMPT = list(range(10, 23))  # 13 tokens: 3 full blocks of 4 that the samples share


def _engine() -> LLMEngine:
    return engine_over(fake_model(V), EngineArgs(max_num_batched_tokens=32, max_num_seqs=4,
                                                 block_size=4),
                       tokenizer=None, max_model_len=64, num_blocks=40)


def _drain(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        check_invariants(engine.state)
    assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1
    return outs


def test_offline_n_gives_one_output_of_n_completions_and_frees_every_block() -> None:
    engine = _engine()
    llm = LLM.from_engine(engine)
    greedy = SamplingParams(n=2, max_tokens=5, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": [3, 1, 4]}],
                        greedy, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2, 2]
    for o, prompt in zip(outs, (PROMPT, [3, 1, 4]), strict=True):
        assert o.finished and [c.index for c in o.outputs] == [0, 1]
        assert [list(c.token_ids) for c in o.outputs] == [fake_greedy(prompt, 5, V)] * 2
    assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1
    assert not engine.has_unfinished_requests()


def test_seeded_samples_are_the_servers_children_and_differ() -> None:
    """Sample i of a seeded request is the request with seed + i, the rule the HTTP server
    follows too (both call `child_params`)."""
    sampled = SamplingParams(n=3, max_tokens=8, temperature=50.0, seed=7, ignore_eos=True,
                             output_kind=RequestOutputKind.FINAL_ONLY)
    engine = _engine()
    engine.add_request("p", {"prompt_token_ids": PROMPT}, sampled)
    (parent,) = _drain(engine)
    texts = [list(c.token_ids) for c in parent.outputs]
    assert len(set(map(tuple, texts))) == 3
    assert [sp.seed for sp in child_params(sampled)] == [7, 8, 9]
    alone = _engine()
    for i, sp in enumerate(child_params(sampled)):
        assert sp.n == 1
        alone.add_request(f"c{i}", {"prompt_token_ids": PROMPT}, sp)
    by_id = {o.request_id: o for o in _drain(alone)}
    assert [list(by_id[f"c{i}"].outputs[0].token_ids) for i in range(3)] == texts


def test_streamed_samples_come_under_the_parent_with_their_index_and_abort_frees() -> None:
    engine = _engine()
    params = SamplingParams(n=2, max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("s", {"prompt_token_ids": PROMPT}, params)
    outs = _drain(engine)
    assert {o.request_id for o in outs} == {"s"}
    assert all(len(o.outputs) == 1 for o in outs)
    assert {o.outputs[0].index for o in outs} == {0, 1}
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    engine.add_request("a", {"prompt_token_ids": PROMPT}, params)
    engine.step()
    aborted = engine.abort_request("a")  # each sample's last output, the parent's last
    assert [o.request_id for o in aborted] == ["a", "a"] and aborted[-1].finished
    assert sorted(o.outputs[0].index for o in aborted) == [0, 1]
    assert {o.outputs[0].finish_reason for o in aborted} == {"abort"}
    assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1
    assert not engine.has_unfinished_requests()


def test_n_below_one_is_refused_naming_it_and_stream_refuses_n() -> None:
    with pytest.raises(SamplingParamsError, match="n .samples per prompt. must be an integer "
                                                  ">= 1, got 0") as e:
        SamplingParams(n=0)
    assert e.value.param == "n"
    llm = LLM.from_engine(_engine())
    with pytest.raises(SamplingParamsError, match="n=2") as e:
        stream(llm, [{"prompt_token_ids": PROMPT}], SamplingParams(n=2))
    assert e.value.param == "n" and not llm.llm_engine.has_unfinished_requests()
