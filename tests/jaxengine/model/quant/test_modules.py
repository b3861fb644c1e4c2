"""Per-channel quantization and the quantized modules, each against its float module: the
round trip's error bound, exact zero channels, a `QuantizedLinear` computing x @ (values *
scale), the quantized embedding and experts against their dequantized float weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxengine.model.layers import COLUMN, ROW, Embedder, linear
from jaxengine.model.mesh import make_mesh
from jaxengine.model.moe import SparseMoE
from jaxengine.model.quant import (
    FORMATS,
    FP8,
    INT8,
    QuantizedExperts,
    QuantizedLinear,
    dequantize,
    quantize,
    quantize_modules,
)

MESH = make_mesh(jax.devices()[:1])
# Round to nearest: int8 within half a step (scale/2); e4m3 keeps 3 mantissa bits, so within
# 2^-4 of the magnitude (and an absolute half step below the normal range).
RELATIVE = {"int8": 0.0, "fp8": 2.0**-4}
ABSOLUTE = {"int8": 0.5, "fp8": 2.0**-10 * 448}  # in units of the channel's scale


@pytest.mark.parametrize("fmt", [INT8, FP8], ids=lambda f: f.name)
@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax"])
def test_round_trip_is_within_half_a_step_per_channel(fmt, xp) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 40, 24)).astype(np.float32) * rng.uniform(0.01, 5, (1, 1, 24))
    w[1, :, 5] = 0.0  # an all-zero column
    values, scale = quantize(w, fmt, axis=-2, xp=xp)
    assert values.shape == w.shape and values.dtype == fmt.dtype
    assert scale.shape == (3, 24) and scale.dtype == np.float32
    np.testing.assert_allclose(np.asarray(scale)[0], np.abs(w[0]).max(axis=0) / fmt.qmax,
                               rtol=1e-6)
    assert np.asarray(scale)[1, 5] == 1.0 and not np.asarray(values)[1, :, 5].astype(bool).any()
    back = np.asarray(dequantize(jnp.asarray(values), jnp.asarray(scale), axis=-2,
                                 dtype=jnp.float32))
    bound = (RELATIVE[fmt.name] * np.abs(w) + ABSOLUTE[fmt.name] * np.asarray(scale)[:, None])
    assert (np.abs(back - w) <= bound * (1 + 1e-6)).all()
    # the largest entry of each channel is exact
    top = np.abs(w).argmax(axis=-2)
    np.testing.assert_allclose(np.take_along_axis(back, top[:, None], -2),
                               np.take_along_axis(w, top[:, None], -2), rtol=1e-6)


def test_numpy_and_jax_quantize_to_the_same_values() -> None:
    """The loader (numpy, on the host) and a fresh model (jax) must agree bit for bit."""
    w = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    for fmt in (INT8, FP8):
        a, sa = quantize(w, fmt, axis=-2)
        b, sb = quantize(w, fmt, axis=-2, xp=jnp)
        np.testing.assert_array_equal(a.view(np.uint8), np.asarray(b).view(np.uint8))
        np.testing.assert_array_equal(sa, np.asarray(sb))
    assert FP8.dtype == np.dtype(ml_dtypes.float8_e4m3fn)


def _dequantized(values, scale, axis=-2) -> np.ndarray:
    return np.asarray(values).astype(np.float64) * np.expand_dims(np.asarray(scale), axis)


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("bias", [False, True])
def test_a_quantized_linear_is_x_times_its_dequantized_kernel(name: str, bias: bool) -> None:
    lin = linear(48, 20, sharding=COLUMN, mesh=MESH, dtype=jnp.float32, rngs=nnx.Rngs(0),
                 use_bias=bias)
    if bias:
        lin.bias[...] = jnp.linspace(-1, 1, 20)
    q = FORMATS[name].linear(lin)
    assert isinstance(q, QuantizedLinear) and q.kernel[...].dtype == FORMATS[name].channel.dtype
    x = np.random.default_rng(2).standard_normal((5, 48)).astype(np.float32)
    want = x.astype(np.float64) @ _dequantized(q.kernel[...], q.kernel_scale[...])
    want += np.asarray(lin.bias[...]) if bias else 0.0
    got = q(jnp.asarray(x))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # and near the float layer: the round trip's error only
    np.testing.assert_allclose(got, lin(jnp.asarray(x)), atol=0.02 if name == "int8" else 0.1)


def test_a_logits_head_keeps_float32_results_for_bfloat16_inputs() -> None:
    head = linear(32, 64, sharding=COLUMN, mesh=MESH, dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                  preferred_element_type=jnp.float32)
    q = FORMATS["int8"].linear(head)
    out = q(jnp.ones((3, 32), jnp.bfloat16))
    assert out.dtype == jnp.float32
    down = FORMATS["int8"].linear(linear(32, 8, sharding=ROW, mesh=MESH, dtype=jnp.bfloat16,
                                         rngs=nnx.Rngs(0)))
    assert down(jnp.ones((3, 32), jnp.bfloat16)).dtype == jnp.bfloat16


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_a_quantized_embedding_looks_up_and_projects_its_dequantized_rows(name: str) -> None:
    emb = Embedder(50, 16, mesh=MESH, dtype=jnp.float32, rngs=nnx.Rngs(3),
                   padded_vocab_size=52)
    q = FORMATS[name].embedder(emb)
    table = _dequantized(q.embedding[...], q.embedding_scale[...], axis=-1)  # [V', D]
    assert q.embedding_scale[...].shape == (52,)
    assert (np.asarray(q.embedding_scale[...])[50:] == 1.0).all()  # zero padding rows
    ids = jnp.asarray([0, 7, 49, 3, 7])
    np.testing.assert_allclose(q.encode(ids), table[np.asarray(ids)], rtol=1e-6)
    h = np.random.default_rng(4).standard_normal((3, 16)).astype(np.float32)
    np.testing.assert_allclose(q.decode(jnp.asarray(h)), h @ table.T, rtol=1e-5, atol=1e-6)


def test_quantized_experts_compute_the_moe_of_their_dequantized_weights() -> None:
    """The MoE layer with int8 experts equals the float layer given the dequantized weights
    (routing identical: the router stays float)."""
    moe = SparseMoE(32, 24, 6, 2, norm_topk_prob=True, shared_intermediate_size=16, mesh=MESH,
                    dtype=jnp.float32, rngs=nnx.Rngs(5), grouped_impl="xla")
    x = jnp.asarray(np.random.default_rng(6).standard_normal((9, 32)).astype(np.float32))
    quantize_modules(moe, FORMATS["int8"])
    assert isinstance(moe.experts, QuantizedExperts)
    assert isinstance(moe.gate, nnx.Linear) and isinstance(moe.shared_expert_gate, nnx.Linear)
    assert isinstance(moe.shared_expert.down_proj, QuantizedLinear)
    got = moe(x, jnp.int32(7))
    assert moe.experts.gate_proj_scale[...].shape == (6, 24)
    assert moe.experts.down_proj_scale[...].shape == (6, 32)
    ref = SparseMoE(32, 24, 6, 2, norm_topk_prob=True, shared_intermediate_size=16, mesh=MESH,
                    dtype=jnp.float32, rngs=nnx.Rngs(5), grouped_impl="xla")
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(ref.experts, name)[...] = jnp.asarray(_dequantized(
            getattr(moe.experts, name)[...], getattr(moe.experts, f"{name}_scale")[...]),
            jnp.float32)
    ref.shared_expert = moe.shared_expert
    np.testing.assert_allclose(got, ref(x, jnp.int32(7)), rtol=1e-5, atol=1e-6)


def test_an_unknown_quantization_is_named_with_the_supported_ones() -> None:
    from jaxengine.model.quant import weight_format
    with pytest.raises(ValueError, match=r"quantization='awq' is not supported; use one of "
                                         r"int8, fp8"):
        weight_format("awq")
    assert weight_format(None) is None
