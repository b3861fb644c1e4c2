"""The model's attention over a quantized cache: each layer hands the kernel its own k_scale /
v_scale for an fp8 cache (looped and scanned layers alike) and 1.0 for a float cache; an fp8
cache holds the keys rotated (kv_rotation.py), a float one as they are."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.model.config import ModelConfig
from jaxengine.model.decoder import Model
from jaxengine.model.kv_cache import init_kv_cache
from jaxengine.model.kv_rotation import kv_rotation
from jaxengine.model.step import RequestChunk, make_model_step, pack_batch, split_model

SCALES = ((2.0, 4.0), (0.5, 0.25))  # per layer (k_scale, v_scale)
PROMPT = list(range(3, 14))  # 11 tokens over pages 1, 2, 3 of 4 slots


def _cache_after_prompt(kv_cache_dtype: str, *, scan_layers: bool,
                        kv_scales: tuple[tuple[float, float], ...] | None) -> np.ndarray:
    """The f32 cache [Ly, P, L, 2K, H] a model writes for PROMPT, read back as stored."""
    cfg = ModelConfig.tiny(kv_scales=kv_scales)
    graphdef, state = split_model(Model(cfg, seed=5, scan_layers=scan_layers))
    step = jax.jit(make_model_step(graphdef), donate_argnames=("kv",))
    kv = init_kv_cache(cfg, num_blocks=8, block_size=4, dtype=jnp.dtype(kv_cache_dtype))
    batch = pack_batch([RequestChunk(token_ids=PROMPT, start=0, block_table=[1, 2, 3])],
                       num_tokens=16, max_seqs=2, max_blocks=4, block_size=4)
    kv, _ = step(state, kv, batch)
    assert kv.dtype == jnp.dtype(kv_cache_dtype)
    return np.asarray(kv.astype(jnp.float32))


@functools.cache
def _exact(scan_layers: bool) -> np.ndarray:
    """The keys and values as computed: a float32 cache's."""
    return _cache_after_prompt("float32", scan_layers=scan_layers, kv_scales=None)


def _fp8(x: np.ndarray) -> np.ndarray:
    """`x` rounded to float8_e4m3fn (to nearest, as XLA casts), back in float32."""
    return x.astype(jnp.float8_e4m3fn).astype(np.float32)


def _tokens(cache: np.ndarray, layer: int) -> np.ndarray:
    """Layer `layer`'s rows of PROMPT's tokens, [tokens, 2K, H] (pages 1..3 in order)."""
    return cache[layer, 1:4].reshape(-1, 4, 8)[:len(PROMPT)]


@pytest.mark.parametrize("scan_layers", [False, True], ids=["looped", "scanned"])
def test_an_fp8_cache_holds_k_over_each_layers_k_scale(scan_layers: bool) -> None:
    exact = _exact(scan_layers)
    scaled = _cache_after_prompt("float8_e4m3fn", scan_layers=scan_layers, kv_scales=SCALES)
    # Layer 0 sees the same inputs as with a float32 cache: its entries are k R / k_scale
    # and v / v_scale rounded to fp8 (R the keys' rotation), to within one fp8 step where the
    # rotated key's last float32 bit lands on a rounding tie.
    (k_scale, v_scale), k, v = SCALES[0], _tokens(exact, 0)[:, 0::2], _tokens(exact, 0)[:, 1::2]
    assert np.abs(k).max() > 0 and np.abs(v).max() > 0
    rotated = k @ kv_rotation(k.shape[-1])
    np.testing.assert_allclose(_tokens(scaled, 0)[:, 0::2], _fp8(rotated / np.float32(k_scale)),
                               rtol=2**-3, atol=2**-9)
    assert not np.allclose(_tokens(scaled, 0)[:, 0::2], _fp8(k / np.float32(k_scale)),
                           rtol=2**-3, atol=2**-9)
    np.testing.assert_array_equal(_tokens(scaled, 0)[:, 1::2], _fp8(v / np.float32(v_scale)))
    # Layer 1's inputs went through layer 0's quantized cache, so its k and v are close to the
    # float32 cache's, not equal; read back with its own scales (not layer 0's) they match.
    (k_scale, v_scale), k, v = SCALES[1], _tokens(exact, 1)[:, 0::2], _tokens(exact, 1)[:, 1::2]
    stored = _tokens(scaled, 1)
    np.testing.assert_allclose(stored[:, 0::2] * k_scale, k @ kv_rotation(k.shape[-1]), rtol=0.1,
                               atol=0.02)
    np.testing.assert_allclose(stored[:, 1::2] * v_scale, v, rtol=0.1, atol=0.02)


def test_a_float_cache_ignores_the_scales() -> None:
    scaled = _cache_after_prompt("bfloat16", scan_layers=False, kv_scales=SCALES)
    plain = _cache_after_prompt("bfloat16", scan_layers=False, kv_scales=None)
    assert np.abs(plain).max() > 0
    np.testing.assert_array_equal(scaled, plain)
