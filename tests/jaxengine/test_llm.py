"""`LLM.generate` / `LLM.chat` argument handling over the fake model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from jaxengine.engine.args import EngineArgs
from jaxengine.llm import LLM
from jaxengine.model.fake import fake_greedy, fake_model
from scheduler import SamplingParams
from tests.engine_helpers import engine_over
from tests.jaxengine.engine.test_llm_engine import FakeTokenizer, V

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class ChatTokenizer(FakeTokenizer):
    """The fake tokenizer plus a chat template: a role token (user 1, assistant 2) + content."""

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        role = {"user": self.decode([1]), "assistant": self.decode([2])}
        text = "".join(role[m["role"]] + m["content"] for m in messages)
        return text + (role["assistant"] if add_generation_prompt else "")


def _llm() -> LLM:
    args = EngineArgs(max_num_batched_tokens=32, max_num_seqs=4, block_size=4)
    engine = engine_over(fake_model(V), args, tokenizer=ChatTokenizer(), max_model_len=128,
                         num_blocks=64)
    return LLM.from_engine(engine)


def test_mixed_prompt_kinds_and_per_prompt_params() -> None:
    llm, tok = _llm(), ChatTokenizer()
    text = tok.decode([3, 4, 5])
    params = [GREEDY, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)]
    outs = llm.generate([text, {"prompt_token_ids": [3, 4, 5]}], params, use_tqdm=False)
    assert outs[0].prompt == text and outs[1].prompt is None
    assert list(outs[0].outputs[0].token_ids) == fake_greedy([3, 4, 5], 4, V)
    assert list(outs[1].outputs[0].token_ids) == fake_greedy([3, 4, 5], 2, V)
    single = llm.generate({"prompt": text}, GREEDY, use_tqdm=True)
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_argument_errors() -> None:
    llm = _llm()
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["ab", "cd"], [GREEDY] * 3, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([1, 2, 3], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_renders_the_template() -> None:
    llm, tok = _llm(), ChatTokenizer()
    hi, yo = tok.decode([10, 11]), tok.decode([12])
    conv = [{"role": "user", "content": hi}]
    outs = llm.chat([conv, conv + [{"role": "assistant", "content": yo}]], GREEDY,
                    use_tqdm=False)
    assert outs[0].prompt_token_ids == [1, 10, 11, 2]
    assert outs[0].prompt == tok.decode([1, 10, 11, 2])
    assert list(outs[0].outputs[0].token_ids) == fake_greedy([1, 10, 11, 2], 4, V)
    assert outs[1].prompt_token_ids == [1, 10, 11, 2, 12, 2]
    assert llm.chat(conv, GREEDY, use_tqdm=False)[0].prompt_token_ids == [1, 10, 11, 2]


def test_generate_asks_only_for_final_outputs() -> None:
    """`generate` reads finished outputs only, so the engine builds none per step (vLLM's
    FINAL_ONLY); the outputs equal a cumulative run's, and `add_requests` (what streaming
    uses) still gets one per step."""
    llm = _llm()
    steps: list[list[Any]] = []
    step = llm.llm_engine.step

    def recorded() -> list[Any]:
        outs = step()
        steps.append(outs)
        return outs

    llm.llm_engine.step = recorded  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    final = llm.generate([{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": [7]}], params,
                         use_tqdm=False)
    assert all(o.finished for outs in steps for o in outs)
    assert sum(len(outs) for outs in steps) == 2

    steps.clear()
    ids = llm.add_requests([{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": [7]}], params)
    done = {}
    while llm.llm_engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in llm.llm_engine.step() if o.finished)
    assert sum(len(outs) for outs in steps) > 2
    for a, b in zip(final, (done[i] for i in ids), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
        assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob
