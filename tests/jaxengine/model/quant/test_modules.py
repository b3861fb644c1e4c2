"""Quantization in groups (int8) and per channel (fp8), and the quantized modules, each
against its float module: the round trip's error bound, exact zero channels, a
`QuantizedLinear` computing x @ (values * scale), the quantized embedding and experts against
their dequantized float weights, and a contracted size off the group refused by name; fp8
x fp8 dots (activations quantized per token) where the platform multiplies fp8."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

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
from jaxengine.model.quant.formats import multiplies_fp8

MESH = make_mesh(jax.devices()[:1])
# Round to nearest: int8 within half a step (scale/2); e4m3 keeps 3 mantissa bits, so within
# 2^-4 of the magnitude (and an absolute half step below the normal range).
RELATIVE = {"int8": 0.0, "fp8": 2.0**-4}
ABSOLUTE = {"int8": 0.5, "fp8": 2.0**-10 * 448}  # in units of the group's scale


def _per_weight(scale, shape: tuple[int, ...], axis: int) -> np.ndarray:
    """Each weight's scale, f64 of `shape`: groups repeated along `axis`, or one per channel."""
    scale = np.asarray(scale, np.float64)
    if scale.ndim < len(shape):
        return np.broadcast_to(np.expand_dims(scale, axis), shape)
    return np.repeat(scale, shape[axis] // scale.shape[axis], axis)


def _dequantized(values, scale, axis=-2) -> np.ndarray:
    return np.asarray(values).astype(np.float64) * _per_weight(scale, values.shape, axis)


@pytest.mark.parametrize("fmt", [INT8, FP8], ids=lambda f: f.name)
@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax"])
def test_round_trip_is_within_half_a_step_per_group(fmt, xp) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 64, 24)).astype(np.float32) * rng.uniform(0.01, 5, (1, 64, 24))
    w[1, :, 5] = 0.0  # an all-zero column
    values, scale = quantize(w, fmt, axis=-2, xp=xp)
    assert values.shape == w.shape and values.dtype == fmt.dtype
    groups = w.reshape(3, -1, fmt.group or 64, 24)  # [3, groups, group, 24]
    assert scale.shape == ((3, 2, 24) if fmt is INT8 else (3, 24))
    assert scale.dtype == np.float32
    amax = np.abs(groups).max(axis=2)
    np.testing.assert_allclose(np.asarray(scale).reshape(3, -1, 24),
                               np.where(amax > 0, amax / fmt.qmax, 1.0), rtol=1e-6)
    assert (np.asarray(scale)[1, ..., 5] == 1.0).all()  # the zero column's
    assert not np.asarray(values)[1, :, 5].astype(bool).any()
    back = np.asarray(dequantize(jnp.asarray(values), jnp.asarray(scale), axis=-2,
                                 dtype=jnp.float32))
    np.testing.assert_allclose(back, _dequantized(values, scale), rtol=1e-6)
    bound = RELATIVE[fmt.name] * np.abs(w) + ABSOLUTE[fmt.name] * _per_weight(scale, w.shape, -2)
    assert (np.abs(back - w) <= bound * (1 + 1e-6)).all()
    # the largest entry of each group is exact
    back_groups = back.reshape(groups.shape)
    top = np.abs(groups).argmax(axis=2)[:, :, None]
    np.testing.assert_allclose(np.take_along_axis(back_groups, top, 2),
                               np.take_along_axis(groups, top, 2), rtol=1e-6)


def test_int8_groups_are_32_inputs_or_the_gcd_and_a_size_without_8_is_refused() -> None:
    assert INT8.group == 32 and FP8.group is None
    assert [INT8.group_of(n) for n in (576, 48, 16, 8)] == [32, 16, 16, 8]
    down = FORMATS["int8"].linear(linear(48, 32, sharding=ROW, mesh=MESH, dtype=jnp.float32,
                                         rngs=nnx.Rngs(0)))
    assert down.kernel_scale[...].shape == (3, 32)  # 48 inputs: groups of 16
    with pytest.raises(ValueError, match=r"quantization='int8' scales groups of gcd\(size, 32\) "
                                         r">= 8 inputs, and a size of 100 is not a multiple of 8 "
                                         r"\(layers/mlp/down_proj/kernel \[100, 32\] contracts "
                                         r"100 inputs\); use quantization=None or 'fp8'"):
        FORMATS["int8"].linear(linear(100, 32, sharding=ROW, mesh=MESH, dtype=jnp.float32,
                                      rngs=nnx.Rngs(0)), ("layers", "mlp", "down_proj"))
    with pytest.raises(ValueError, match=r"embed_tokens/embedding \[52, 36\] contracts 36"):
        FORMATS["int8"].embedder(Embedder(50, 36, mesh=MESH, dtype=jnp.float32,
                                          rngs=nnx.Rngs(3), padded_vocab_size=52),
                                 ("embed_tokens",))


def test_numpy_and_jax_quantize_to_the_same_values() -> None:
    """The loader (numpy, on the host) and a fresh model (jax) must agree bit for bit."""
    w = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    for fmt in (INT8, FP8):
        a, sa = quantize(w, fmt, axis=-2)
        b, sb = quantize(w, fmt, axis=-2, xp=jnp)
        np.testing.assert_array_equal(a.view(np.uint8), np.asarray(b).view(np.uint8))
        np.testing.assert_array_equal(sa, np.asarray(sb))
    assert FP8.dtype == np.dtype(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("bias", [False, True])
def test_a_quantized_linear_is_x_times_its_dequantized_kernel(name: str, bias: bool) -> None:
    lin = linear(64, 20, sharding=COLUMN, mesh=MESH, dtype=jnp.float32, rngs=nnx.Rngs(0),
                 use_bias=bias)
    if bias:
        lin.bias[...] = jnp.linspace(-1, 1, 20)
    q = FORMATS[name].linear(lin)
    assert isinstance(q, QuantizedLinear) and q.kernel[...].dtype == FORMATS[name].channel.dtype
    x = np.random.default_rng(2).standard_normal((5, 64)).astype(np.float32)
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
    emb = Embedder(50, 64, mesh=MESH, dtype=jnp.float32, rngs=nnx.Rngs(3),
                   padded_vocab_size=52)
    q = FORMATS[name].embedder(emb)
    table = _dequantized(q.embedding[...], q.embedding_scale[...], axis=-1)  # [V', D]
    assert q.embedding_scale[...].shape == ((52, 2) if name == "int8" else (52,))
    assert (np.asarray(q.embedding_scale[...])[50:] == 1.0).all()  # zero padding rows
    ids = jnp.asarray([0, 7, 49, 3, 7])
    np.testing.assert_allclose(q.encode(ids), table[np.asarray(ids)], rtol=1e-6)
    h = np.random.default_rng(4).standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_allclose(q.decode(jnp.asarray(h)), h @ table.T, rtol=1e-5, atol=1e-6)


def test_quantized_experts_compute_the_moe_of_their_dequantized_weights() -> None:
    """The MoE layer with int8 experts equals the float layer given the dequantized weights
    (routing identical: the router stays float)."""
    moe = SparseMoE(64, 32, 6, 2, norm_topk_prob=True, shared_intermediate_size=32, mesh=MESH,
                    dtype=jnp.float32, rngs=nnx.Rngs(5), grouped_impl="xla")
    x = jnp.asarray(np.random.default_rng(6).standard_normal((9, 64)).astype(np.float32))
    quantize_modules(moe, FORMATS["int8"])
    assert isinstance(moe.experts, QuantizedExperts)
    assert isinstance(moe.gate, nnx.Linear) and isinstance(moe.shared_expert_gate, nnx.Linear)
    assert isinstance(moe.shared_expert.down_proj, QuantizedLinear)
    got = moe(x, jnp.int32(7))
    assert moe.experts.gate_proj_scale[...].shape == (6, 2, 32)  # [E, D / 32, F]
    assert moe.experts.down_proj_scale[...].shape == (6, 1, 64)  # [E, F / 32, D]
    ref = SparseMoE(64, 32, 6, 2, norm_topk_prob=True, shared_intermediate_size=32, mesh=MESH,
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


@pytest.mark.parametrize(("platform", "kind", "fp8"), [
    ("tpu", "TPU v6 lite", True), ("tpu", "TPU v5p", True), ("tpu", "TPU7x", True),
    ("tpu", "TPU v5 lite", False), ("tpu", "TPU v4", False),
    ("gpu", "NVIDIA H200", True), ("gpu", "NVIDIA H100 80GB HBM3", True),
    ("gpu", "NVIDIA L40S", True), ("gpu", "NVIDIA A100-SXM4-80GB", False),
    ("cpu", "cpu", False)])
def test_fp8_dots_are_chosen_where_the_matrix_units_multiply_fp8(
        platform: str, kind: str, fp8: bool) -> None:
    device = AbstractDevice(device_kind=kind, num_cores=1, platform=platform)
    mesh = AbstractMesh((1,), ("tp",), (AxisType.Auto,), abstract_device=device)
    assert multiplies_fp8(mesh) is fp8
    assert multiplies_fp8(MESH) is False  # this machine's CPU


def test_an_fp8_dot_quantizes_each_token_to_fp8_with_its_own_scale() -> None:
    lin = linear(64, 20, sharding=COLUMN, mesh=MESH, dtype=jnp.float32, rngs=nnx.Rngs(0))
    q = QuantizedLinear(lin, FP8, fp8_dots=True)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 64)).astype(np.float32) * np.array([[1e-3], [1], [30], [1], [1],
                                                                    [0]], np.float32)
    x[3, 7] = 50.0  # an outlier sets its own row's scale only
    # the oracle: each row's largest magnitude to 448, rounded to e4m3, then float64
    amax = np.abs(x).max(axis=1, keepdims=True)
    x_scale = np.where(amax > 0, amax * np.float32(1 / 448), 1.0).astype(np.float32)
    xq = (x / x_scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * x_scale
    want = xq @ _dequantized(q.kernel[...], q.kernel_scale[...])
    got = np.asarray(q(jnp.asarray(x)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert not got[5].any()  # a zero row (padding) stays zero
    # the activations really went through fp8: weight-only is further from the oracle
    weight_only = np.asarray(QuantizedLinear(lin, FP8)(jnp.asarray(x)))
    assert np.abs(weight_only - want).max() > 100 * np.abs(got - want).max()


def test_fp8_weights_on_this_cpu_are_weight_only() -> None:
    lin = linear(64, 20, sharding=COLUMN, mesh=MESH, dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert FORMATS["fp8"].linear(lin).fp8_dots is False
