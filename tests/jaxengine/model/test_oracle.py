"""The model against HF transformers: random tiny models of each architecture (fixtures made by
tests/make_fixtures.py) give the same logits, in one pass and as prefill + paged decode, with the
layers looped (the CPU layout) and scanned; the engine's greedy tokens and logprobs are
transformers' where the fixture has them (prompts longer than a sliding window)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.loading import load_model
from jaxengine.loading.hf import SafetensorsSource, read_hf_config
from jaxengine.loading.weights import load_weights
from jaxengine.model.decoder import Model
from jaxengine.model.step import RequestChunk
from tests.fixtures.model_helpers import TINY_DIRS, PagedRunner, shuffled_table

F32_TOL = 1e-4  # observed max |diff| ~3e-5 (Gemma 3) on logits of magnitude ~2
LOGPROB_TOL = 2e-3  # the bound for logprobs in f32


def _scanned(path: str) -> Model:
    """The fixture's model with its layers stacked and scanned (the accelerators' layout)."""
    cfg = read_hf_config(path)
    source = SafetensorsSource(path)
    try:
        weights = load_weights(cfg, source, dtype=jnp.float32, where=path)
    finally:
        source.close()
    return Model(cfg, weights=weights, scan_layers=True)


@pytest.fixture(scope="module", params=TINY_DIRS, ids=lambda p: p.name)
def tiny(request: pytest.FixtureRequest) -> tuple:
    model, cfg, _ = load_model(str(request.param))
    oracle = np.load(request.param / "oracle.npz")
    return request.param, model, oracle["input_ids"].tolist(), oracle["logits"]


def _pages(ids: list[int]) -> int:
    return -(-len(ids) // 4)  # PagedRunner's block size


def test_full_prompt_matches_transformers(tiny: tuple) -> None:
    _, model, ids, expected = tiny
    runner = PagedRunner(model)
    table = shuffled_table(32, _pages(ids), seed=0)
    got = runner.run([RequestChunk(token_ids=ids, start=0, block_table=table)],
                     num_tokens=max(16, len(ids)))[0]
    np.testing.assert_allclose(got, expected, atol=F32_TOL, rtol=0)


@pytest.mark.parametrize("layout", ["looped", "scanned"])
def test_prefill_then_paged_decode_matches_transformers(tiny: tuple, layout: str) -> None:
    path, model, ids, expected = tiny
    model = model if layout == "looped" else _scanned(str(path))
    runner = PagedRunner(model, fill=np.nan)  # pages never written must not leak
    table = shuffled_table(32, _pages(ids), seed=1)
    got = runner.run_chunked(ids, sizes=[5] + [1] * len(ids), table=table)
    np.testing.assert_allclose(got, expected, atol=F32_TOL, rtol=0)


GREEDY_DIRS = [p for p in TINY_DIRS if "greedy_ids" in np.load(p / "oracle.npz")]
# The reference attention is checked against the platform's kernel case by case in
# tests/jaxengine_kernels/; through the whole engine, one windowed family runs it by default and
# the rest (the reference being ~3x slower on CPU) run with -m slow.
REFERENCE_BY_DEFAULT = "mistral_window"


def _cases() -> list:
    cases = []
    for path in GREEDY_DIRS:
        cases.append(pytest.param(path, None, id=f"{path.name}-None"))  # the platform's kernel
        marks = () if path.name == REFERENCE_BY_DEFAULT else (pytest.mark.slow,)
        cases.append(pytest.param(path, "reference", id=f"{path.name}-reference", marks=marks))
    return cases


@pytest.mark.parametrize(("path", "backend"), _cases())
def test_llm_greedy_tokens_and_logprobs_are_transformers(path, backend: str | None) -> None:
    """Through the whole engine (scheduler, chunked prefill, paged cache of 4-token blocks,
    sampler): past the window, a sliding layer must see exactly the last W keys."""
    oracle = np.load(path / "oracle.npz")
    llm = LLM(str(path), skip_tokenizer_init=True, max_num_seqs=2, block_size=4,
              max_num_batched_tokens=16, num_gpu_blocks_override=80,
              attention_backend=backend)
    params = SamplingParams(temperature=0.0, max_tokens=len(oracle["greedy_ids"]), logprobs=0,
                            ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": oracle["input_ids"].tolist()}], params)[0]
    completion = out.outputs[0]
    assert list(completion.token_ids) == oracle["greedy_ids"].tolist()
    got = [step[token].logprob for step, token in zip(completion.logprobs,
                                                         completion.token_ids, strict=True)]
    np.testing.assert_allclose(got, oracle["greedy_logprobs"], atol=LOGPROB_TOL, rtol=0)


@pytest.mark.parametrize("name", ["llama3_gqa", "qwen3_qknorm"])
def test_bfloat16_is_close_to_transformers_f32(name: str) -> None:
    path = next(p for p in TINY_DIRS if p.name == name)
    oracle = np.load(path / "oracle.npz")
    model16, _, _ = load_model(str(path), dtype="bfloat16")
    assert model16.embed[...].dtype == jnp.bfloat16
    runner = PagedRunner(model16)
    assert runner.kv.dtype == jnp.bfloat16
    ids = oracle["input_ids"].tolist()
    got = runner.run([RequestChunk(token_ids=ids, start=0, block_table=[3, 1, 2, 4])])[0]
    assert np.abs(got - oracle["logits"]).max() < 0.1  # bf16 keeps ~3 significant digits
