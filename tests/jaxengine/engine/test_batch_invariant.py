"""batch_invariant=True (vLLM's VLLM_BATCH_INVARIANT): a seeded and a greedy request give the
same tokens and logprobs, bit for bit, alone and among many others: other token and request
buckets, other rows, their prompts cut into chunks by the token budget, or all but the last
token found in the prefix cache. A tiny random model with head_dim 64 (the attention kernel's
vectorized dots) and a width where XLA's own mean changed order with the row count. Without the
mode the attention kernel's cached-prefix tails round otherwise
(tests/jaxengine_kernels/test_batch_invariant.py)."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import model_fns
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.model.config import ModelConfig
from jaxengine.model.decoder import Model
from scheduler import SamplingParams
from tests.engine_helpers import engine_over

CFG = ModelConfig.tiny(hidden_size=256, head_dim=64, num_heads=4, num_kv_heads=2,
                       vocab_size=256, max_position_embeddings=512)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, seed=123, logprobs=3, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
# 1 and 2 tokens past three 16-token blocks: a cached prompt's tail is a decode-sized chunk, where
# the whole prompt's last 17 or 18 tokens are one prefill unit (block_q 32).
PROMPTS = {"seeded": [(5 * j + 1) % 250 + 1 for j in range(49)],
           "greedy": [(3 * j + 7) % 250 + 1 for j in range(50)]}


@functools.cache
def _fns(kv_cache_dtype: str | None = None) -> Any:
    return model_fns(Model(CFG, seed=0), CFG, attn_impl="cpu", batch_invariant=True,
                     kv_cache_dtype=kv_cache_dtype)


def _engine(kv_cache_dtype: str | None = None) -> LLMEngine:
    args = EngineArgs(batch_invariant=True, max_num_batched_tokens=128, max_num_seqs=48,
                      block_size=16)
    return engine_over(_fns(kv_cache_dtype), args, tokenizer=None, max_model_len=256,
                       num_blocks=600)


def _run(engine: LLMEngine, crowd: int) -> dict[str, Any]:
    """`crowd` other requests first (prompts of 3 to 120 tokens, sampled and greedy), then the
    two watched ones; their (token ids, logprobs) when all have finished."""
    for i in range(crowd):
        prompt = [(7 * i + 11 * j) % 250 + 1 for j in range(3 + 37 * i % 118)]
        params = SamplingParams(max_tokens=4 + i % 9, temperature=1.0 if i % 2 else 0.0,
                                ignore_eos=True)
        engine.add_request(f"other{i}", {"prompt_token_ids": prompt}, params)
    for name, params in (("seeded", SEEDED), ("greedy", GREEDY)):
        engine.add_request(name, {"prompt_token_ids": PROMPTS[name]}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id in PROMPTS:
                completion = out.outputs[0]
                done[out.request_id] = (completion.token_ids, completion.logprobs)
    return done


# An fp8 cache adds the keys' rotation (model/kv_rotation.py), an XLA dot per token.
@pytest.mark.parametrize("kv_cache_dtype", [None, "float8_e4m3fn"])
def test_a_request_gives_the_same_bits_alone_and_in_a_crowd(kv_cache_dtype: str | None
                                                            ) -> None:
    engine = _engine(kv_cache_dtype)
    alone = _run(engine, crowd=0)
    cached = _run(engine, crowd=40)  # the two prompts cached, all but their last token
    chunked = _run(_engine(kv_cache_dtype), crowd=40)  # a fresh cache: the budget cuts prompts
    assert cached == alone
    assert chunked == alone
    assert len(set(alone["seeded"][0])) > 3  # a real draw, not one token repeated


@pytest.mark.parametrize(("kw", "needs"), [
    (dict(dtype="bfloat16"), "dtype float32"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size=1"),
    (dict(attention_backend="reference"), "attention_backend 'cpu'"),
])
def test_settings_that_rule_it_out_are_refused_by_name(kw: dict[str, Any], needs: str) -> None:
    with pytest.raises(ValueError, match=f"batch_invariant=True needs {needs}"):
        EngineArgs(batch_invariant=True, **kw)


def test_a_model_whose_projections_are_not_packed_is_refused() -> None:
    model = Model(CFG, seed=0)  # refused before anything is packed
    with pytest.raises(ValueError, match=r"needs the packed CPU matmul.*\(pack=False\)"):
        model_fns(model, CFG, attn_impl="cpu", pack=False, batch_invariant=True)
    with pytest.raises(ValueError, match="needs attention_backend='cpu'.*'reference'"):
        model_fns(model, CFG, attn_impl="reference", batch_invariant=True)
