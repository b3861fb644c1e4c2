"""The engine over real models: a tiny random HF checkpoint, and the default model (slow)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import build_engine, model_fns, resolve_config
from jaxengine.llm import LLM
from jaxengine.loading.hf import read_hf_config
from jaxengine.loading.load import load_model
from jaxengine.loading.tokenizer import Tokenizer
from scheduler import SamplingParams
from tests.engine_helpers import engine_over

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
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
    engine = engine_over(fns, args, tokenizer=tokenizer, max_model_len=args.max_model_len,
                         num_blocks=args.num_gpu_blocks_override)
    return LLM.from_engine(engine)


@functools.cache
def _single_request_greedy() -> list[tuple[int, ...]]:
    llm = _llm()
    return [_tokens(llm, [p])[0] for p in _prompts()]


def test_batched_greedy_equals_single_request_greedy() -> None:
    assert _tokens(_llm(), _prompts()) == _single_request_greedy()


@pytest.mark.slow  # 45 s: each new pool compiles again. In the default run: the same against
# an ample pool on the fake model (test_llm_engine.py), and preemption with prefix hits on a
# real checkpoint (tensor_parallel_checks.py, tp=4 against tp=1)
def test_preemption_and_prefix_caching_do_not_change_greedy_outputs() -> None:
    tight = _llm(num_gpu_blocks_override=24)
    assert _tokens(tight, _prompts()) == _single_request_greedy()
    assert tight.llm_engine.state.stats.num_preemptions > 0
    shared = [_prompts()[1][:40] + [i + 1] for i in range(4)]
    cached, plain = _llm(max_num_seqs=2), _llm(enable_prefix_caching=False, max_num_seqs=2)
    assert _tokens(cached, shared) == _tokens(plain, shared)
    assert cached.llm_engine.state.stats.prefix_cache_hits > 0


def test_skip_tokenizer_init_reads_no_tokenizer_and_returns_token_ids(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_tokenizer(*args: Any) -> Any:
        raise AssertionError("skip_tokenizer_init=True, yet the tokenizer was loaded")

    monkeypatch.setattr(Tokenizer, "from_hf_dir", no_tokenizer)
    llm = LLM(str(TINY), skip_tokenizer_init=True, **SMALL, num_gpu_blocks_override=64)
    assert llm.get_tokenizer() is None and llm.llm_engine.eos_token_id is None
    prompt = _prompts()[0]
    (out,) = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == _single_request_greedy()[0]  # as with a tokenizer
    assert out.outputs[0].text == "" and out.prompt is None
    with pytest.raises(ValueError, match=r"skip_tokenizer_init=True\): pass the prompt as"):
        llm.generate("a text prompt", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer.*stop_token_ids"):
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(stop=["x"]), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_kv_pool_that_cannot_hold_max_model_len_is_refused_at_build() -> None:
    # max_model_len=128 in blocks of 4 tokens: 32 blocks, plus the null block
    small = EngineArgs(model=str(TINY), **{**SMALL, "num_gpu_blocks_override": 20})
    with pytest.raises(ValueError, match=(
            r"num_gpu_blocks_override=20 leaves 19 usable KV blocks of 4 tokens, but one "
            r"request of max_model_len=128 tokens needs 32 .* at least 33, or lower "
            r"max_model_len to at most 76")):
        build_engine(small)
    per_block = _loaded()[0].kv_bytes_per_block(4)
    budget = EngineArgs(model=str(TINY), **SMALL, kv_cache_memory_bytes=20 * per_block)
    with pytest.raises(ValueError, match=(
            rf"budget of {20 * per_block} bytes .* holds 20 blocks .* needs 33 blocks: "
            rf"{33 * per_block} bytes .* lower max_model_len to at most 76, or raise the "
            rf"budget \(kv_cache_memory_bytes")):
        build_engine(budget)
    fits = build_engine(EngineArgs(model=str(TINY), **SMALL, kv_cache_memory_bytes=33 * per_block))
    assert fits.scheduler_config.num_blocks == 33
    almost = EngineArgs(**SMALL, kv_cache_memory_bytes=34 * per_block - 1)  # whole blocks only
    config = resolve_config(almost, _loaded()[0], read_hf_config(str(TINY)))
    assert config.scheduler.num_blocks == 33


def test_serve_with_a_kv_pool_too_small_exits_with_the_numbers() -> None:
    cmd = [sys.executable, "-m", "jaxengine", "serve", str(TINY), "--port", "0",
           "--max-model-len", "128", "--block-size", "4", "--num-gpu-blocks-override", "20"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # Were the check missing, the server would start and block: the timeout fails the test.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr
    assert "jaxengine serve: error: num_gpu_blocks_override=20 leaves 19 usable" in proc.stderr


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
