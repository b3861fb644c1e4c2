"""The model against HF transformers: random tiny models of each architecture (fixtures made by
tests/make_fixtures.py) give the same logits, in one pass and as prefill + paged decode."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.loading import load_model
from jaxengine.model.step import RequestChunk
from tests.fixtures.model_helpers import TINY_DIRS, PagedRunner, shuffled_table

F32_TOL = 1e-4  # observed max |diff| ~1e-6 on logits of magnitude ~2


@pytest.fixture(scope="module", params=TINY_DIRS, ids=lambda p: p.name)
def tiny(request: pytest.FixtureRequest) -> tuple:
    model, cfg, _ = load_model(str(request.param))
    oracle = np.load(request.param / "oracle.npz")
    return request.param, model, oracle["input_ids"].tolist(), oracle["logits"]


def test_full_prompt_matches_transformers(tiny: tuple) -> None:
    _, model, ids, expected = tiny
    runner = PagedRunner(model)
    table = shuffled_table(32, 4, seed=0)
    got = runner.run([RequestChunk(token_ids=ids, start=0, block_table=table)])[0]
    np.testing.assert_allclose(got, expected, atol=F32_TOL, rtol=0)


def test_prefill_then_paged_decode_matches_transformers(tiny: tuple) -> None:
    _, model, ids, expected = tiny
    runner = PagedRunner(model, fill=np.nan)  # pages never written must not leak
    table = shuffled_table(32, 4, seed=1)
    got = runner.run_chunked(ids, sizes=[5] + [1] * len(ids), table=table)
    np.testing.assert_allclose(got, expected, atol=F32_TOL, rtol=0)


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
