"""The embedded default model (Q4_1 projections, a Q8_0 tied embedding) served from its blocks
answers as the same file dequantized to float32: greedy tokens on the golden prompt and
logprobs within 1e-3, through the paged step, `LLM`, and generate/score; in <= 0.22x the
bytes of float32 weights."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxengine import LLM, SamplingParams, load_model_fns, score
from jaxengine.loading import load_model
from jaxengine.model.decoder import Model
from jaxengine.model.quant.gguf import GGUFEmbedder, GGUFLinear
from jaxengine.model.step import RequestChunk
from tests.fixtures.model_helpers import DEFAULT_DIR, PagedRunner, default_model, load_json

GREEDY = load_json(DEFAULT_DIR / "greedy.json")
PROMPT, OUT = list(GREEDY["prompt_ids"]), list(GREEDY["greedy_ids"])


@functools.cache
def blocks_model() -> Model:
    """The default model with quantization="gguf", loaded once per test session."""
    return load_model(None, quantization="gguf", with_tokenizer=False)[0]


@functools.cache
def teacher_forced(model: Model) -> np.ndarray:
    """f32[32, V] logprobs of each greedy token's position: prompt and the 32 greedy tokens
    in one prefill."""
    runner = PagedRunner(model, num_blocks=12, block_size=16, max_seqs=2, max_blocks=8)
    ids = PROMPT + OUT
    logits = runner.run([RequestChunk(token_ids=ids, start=0, block_table=[7, 2, 9, 4, 11])],
                        128)[0][len(PROMPT) - 1:-1]
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def _bytes(model: Model) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.slow  # over 20 s: the jnp path dequantizes the 49152-row head each step
def test_greedy_tokens_and_logprobs_equal_the_float_load() -> None:
    blocks, floats = blocks_model(), default_model()[0]
    kinds = {type(m) for _, m in nnx.iter_graph(blocks)}
    assert {GGUFLinear, GGUFEmbedder} <= kinds  # served from blocks, tied head included
    got, want = teacher_forced(blocks), teacher_forced(floats)
    assert got.argmax(-1).tolist() == OUT  # teacher-forced greedy is the greedy run
    assert np.abs(got - want).max() < 1e-3


def test_blocks_take_at_most_022x_the_float_bytes() -> None:
    ratio = _bytes(blocks_model()) / _bytes(default_model()[0])
    assert ratio <= 0.22, ratio


@pytest.mark.slow  # over 20 s: the jnp path dequantizes the 49152-row head each step
def test_llm_generates_the_greedy_tokens_with_their_logprobs() -> None:
    llm = LLM(quantization="gguf", skip_tokenizer_init=True, max_num_seqs=2,
              max_num_batched_tokens=64, block_size=16, precompile=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0]
    assert list(out.token_ids) == OUT[:8]
    want = teacher_forced(default_model()[0])
    got = [next(iter(step.values())).logprob for step in out.logprobs]
    np.testing.assert_allclose(got, want[np.arange(8), OUT[:8]], rtol=0, atol=1e-3)


@pytest.mark.slow  # over 20 s: the jnp path dequantizes the 49152-row head each step
def test_score_gives_the_float_logprobs() -> None:
    fns, _ = load_model_fns(None, quantization="gguf")
    out = score(fns, np.asarray([PROMPT]), np.asarray([OUT]), block_size=16)
    want = teacher_forced(default_model()[0])[np.arange(32), OUT]
    np.testing.assert_allclose(np.asarray(out.logprobs)[0], want, rtol=0, atol=1e-3)
    assert bool(np.asarray(out.is_greedy)[0])
