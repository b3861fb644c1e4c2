"""The engine over real models: a tiny random HF checkpoint, and the default model (slow)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from jaxengine.engine import LLMEngine
from jaxengine.engine_args import EngineArgs
from jaxengine.engine_model import model_fns
from jaxengine.llm import LLM
from jaxengine.loading.load import load_model
from scheduler import SamplingParams

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TINY = FIXTURES / "tiny" / "llama_tied_mha"
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SMALL = dict(max_num_batched_tokens=32, max_num_seqs=4, block_size=4, max_model_len=128)


@functools.cache
def _prompts() -> list[list[int]]:
    # lengths 3..45: chunked prefills (budget 32) next to decodes
    return [[(7 * i + 3 * j) % 100 + 1 for j in range(n)] for i, n in enumerate((3, 45, 17, 8, 29))]


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    engine = llm.llm_engine
    assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1
    return [o.outputs[0].token_ids for o in outs]


@functools.cache
def _loaded() -> tuple[Any, Any]:
    model, cfg, tokenizer = load_model(str(TINY))
    return model_fns(model, cfg, attn_impl="reference"), tokenizer


def _llm(**kw: Any) -> LLM:
    """An LLM over the tiny model, loaded once so all engines share compiled executables."""
    fns, tokenizer = _loaded()
    args = EngineArgs(**{**SMALL, "num_gpu_blocks_override": 200, **kw})
    engine = LLMEngine(fns, args, tokenizer=tokenizer, max_model_len=args.max_model_len,
                       num_blocks=args.num_gpu_blocks_override)
    return LLM.from_engine(engine)


@functools.cache
def _single_request_greedy() -> list[tuple[int, ...]]:
    llm = _llm()
    return [_tokens(llm, [p])[0] for p in _prompts()]


def test_batched_greedy_equals_single_request_greedy() -> None:
    assert _tokens(_llm(), _prompts()) == _single_request_greedy()


def test_preemption_and_prefix_caching_do_not_change_greedy_outputs() -> None:
    tight = _llm(num_gpu_blocks_override=24)
    assert _tokens(tight, _prompts()) == _single_request_greedy()
    assert tight.llm_engine.state.stats.num_preemptions > 0
    shared = [_prompts()[1][:40] + [i + 1] for i in range(4)]
    cached, plain = _llm(max_num_seqs=2), _llm(enable_prefix_caching=False, max_num_seqs=2)
    assert _tokens(cached, shared) == _tokens(plain, shared)
    assert cached.llm_engine.state.stats.prefix_cache_hits > 0


@pytest.mark.slow
def test_default_model_chat_greedy_matches_transformers() -> None:
    import json

    fixture = json.loads((FIXTURES / "default" / "greedy.json").read_text())
    llm = LLM(max_num_batched_tokens=256, max_num_seqs=4, max_model_len=512,
              num_gpu_blocks_override=128)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    out = llm.chat(fixture["messages"], params, use_tqdm=False)[0]
    assert out.prompt_token_ids == fixture["prompt_ids"]
    # up to and including the first EOS (id 2), where the engine stops
    assert list(out.outputs[0].token_ids) == fixture["greedy_ids"][:8]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"
