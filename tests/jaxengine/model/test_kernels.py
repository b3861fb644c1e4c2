"""The model over the Pallas kernels (TPU and GPU, in interpret mode on CPU) gives the same
hidden states as over the jnp reference, with the cache viewed as layers*P pages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.model.config import ModelConfig
from jaxengine.model.decoder import Model
from jaxengine.model.step import RequestChunk, make_model_step, pack_batch, split_model


def run(impl: str) -> np.ndarray:
    # head_dim 64 and pages of 8: shapes both kernels accept (no fallback to the reference)
    cfg = ModelConfig.tiny("qwen3", hidden_size=64, head_dim=64)
    graphdef, state = split_model(Model(cfg, seed=3))
    step = jax.jit(make_model_step(graphdef, attn_impl=impl, interpret=impl != "reference"),
                   donate_argnames=("kv",))
    kv = jnp.full((cfg.num_layers, 12, 8, 2 * cfg.num_kv_heads, 64), jnp.nan, jnp.float32)
    ids = np.random.default_rng(0).integers(1, 128, 21).tolist()
    out = []
    for start, n in ((0, 13), (13, 7), (20, 1)):
        chunk = RequestChunk(token_ids=ids[start:start + n], start=start, block_table=[7, 3, 9])
        batch = pack_batch([chunk], num_tokens=16, max_seqs=2, max_blocks=4, block_size=8)
        kv, hidden = step(state, kv, batch)
        out.append(np.asarray(hidden[:n]))
    return np.concatenate(out)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_pallas_kernels_match_reference_inside_the_model(impl: str) -> None:
    np.testing.assert_allclose(run(impl), run("reference"), atol=1e-5, rtol=0)
