"""GGUFLinear and GGUFEmbedder against the float modules holding the dequantized weights."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxengine.loading.weights import to_layout
from jaxengine.model.config import ModelConfig
from jaxengine.model.layers import COLUMN, ROW, Embedder, linear
from jaxengine.model.mesh import make_mesh
from jaxengine.model.quant.gguf import (
    GGUFEmbedder,
    GGUFExperts,
    GGUFLinear,
    gguf_embedder,
    gguf_linear,
)
from jaxengine.model.tensor_parallel import tp_layout
from jaxengine_kernels.gguf_blocks import BLOCK_FORMATS, slot_layout, to_slots
from tests.jaxengine_kernels.test_gguf_blocks import random_rows
from tests.parallel_helpers import run_python

Q = gguf.GGMLQuantizationType
MESH = make_mesh(jax.devices()[:1])


def _x(rows: int, cols: int, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    return jax.random.normal(jax.random.key(3), (rows, cols), jnp.float32).astype(dtype)


@pytest.mark.parametrize("qtype", list(BLOCK_FORMATS))
@pytest.mark.parametrize("sharding", [COLUMN, ROW])
def test_linear_equals_float_product(qtype: Q, sharding: tuple) -> None:
    size = BLOCK_FORMATS[qtype].block_size
    blocks = random_rows(qtype, 24, 2 * size)  # W [24, 2*size]
    w = gguf.quants.dequantize(blocks, qtype)
    bias = np.linspace(-1, 1, 24, dtype=np.float32)
    lin = GGUFLinear(jnp.asarray(blocks), qtype, sharding=sharding, mesh=MESH,
                     bias=jnp.asarray(bias))
    assert (lin.in_features, lin.out_features, lin.qtype) == (2 * size, 24, qtype.name)
    x = _x(5, 2 * size)
    got = jax.jit(lambda m, x: m(x, jnp.int32(3)))(lin, x)
    want = np.asarray(x, np.float64) @ w.T.astype(np.float64) + bias
    assert got.dtype == jnp.float32 and got.shape == (5, 24)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_linear_in_bfloat16_is_the_float_linear_of_the_cast_weight() -> None:
    blocks = random_rows(Q.Q4_1, 16, 64)
    w = jnp.asarray(gguf.quants.dequantize(blocks, Q.Q4_1)).astype(jnp.bfloat16)
    x = _x(4, 64, jnp.bfloat16)
    lin = GGUFLinear(jnp.asarray(blocks), Q.Q4_1, sharding=COLUMN, mesh=MESH)
    got = lin(x)
    want = jnp.einsum("ti,oi->to", x, w, preferred_element_type=jnp.float32)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))
    head = GGUFLinear(jnp.asarray(blocks), Q.Q4_1, sharding=COLUMN, mesh=MESH,
                      preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(head(x)), np.asarray(want))


def test_stacked_blocks_are_scanned_a_layer_at_a_time() -> None:
    blocks = jnp.asarray(np.stack([random_rows(Q.Q8_0, 8, 32, seed=s) for s in range(3)]))
    lin = GGUFLinear(blocks, Q.Q8_0, sharding=ROW, mesh=MESH)
    x = _x(2, 32)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def run(x: jax.Array, layer: GGUFLinear) -> tuple[jax.Array, jax.Array]:
        return x, layer(x)

    _, ys = run(x, lin)
    for i in range(3):
        w = gguf.quants.dequantize(np.asarray(blocks[i]), Q.Q8_0)
        np.testing.assert_allclose(np.asarray(ys[i]), np.asarray(x) @ w.T, rtol=1e-5,
                                   atol=1e-5)


def test_a_stack_of_mixed_types_dequantizes_each_layer_by_its_own() -> None:
    """Layers of Q8_0, Q5_0, Q5_0 in one array of slots: each layer's product is that of its
    own type's values, the scan picking the type by the layer's index."""
    qtypes, which = (Q.Q8_0, Q.Q5_0), (0, 1, 1)
    rows = [random_rows(qtypes[w], 8, 64, seed=i) for i, w in enumerate(which)]
    layout = slot_layout(qtypes)
    blocks = np.stack([to_slots(r, qtypes[w], layout) for r, w in zip(rows, which, strict=True)])
    lin = GGUFLinear(jnp.asarray(blocks), qtypes, sharding=ROW, mesh=MESH,
                     which=jnp.asarray(which, jnp.int32))
    assert (lin.qtype, lin.in_features, lin.layout.qtypes) == (None, 64, ("Q8_0", "Q5_0"))
    x = _x(2, 64)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def run(x: jax.Array, layer: GGUFLinear) -> tuple[jax.Array, jax.Array]:
        return x, layer(x)

    _, ys = run(x, lin)
    for i, w in enumerate(which):
        want = np.asarray(x) @ gguf.quants.dequantize(rows[i], qtypes[w]).T
        np.testing.assert_allclose(np.asarray(ys[i]), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q6_K])
def test_embedder_equals_float_embedder(qtype: Q) -> None:
    size = BLOCK_FORMATS[qtype].block_size
    blocks = random_rows(qtype, 10, size)
    blocks[9] = 0  # a padding row
    table = gguf.quants.dequantize(blocks, qtype)
    emb = GGUFEmbedder(jnp.asarray(blocks), qtype, mesh=MESH, dtype=jnp.float32)
    ref = Embedder(10, size, mesh=MESH, dtype=jnp.float32, rngs=nnx.Rngs(0))
    ref.embedding[...] = jnp.asarray(table)
    ids = jnp.array([3, 0, 9, 3, 7], jnp.int32)
    np.testing.assert_array_equal(np.asarray(emb.encode(ids)), table[np.asarray(ids)])
    hidden = _x(3, size)
    np.testing.assert_allclose(np.asarray(emb.decode(hidden)), np.asarray(ref.decode(hidden)),
                               rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(emb.decode(hidden))[:, 9] == 0)


def test_bad_types_are_refused() -> None:
    blocks = jnp.zeros((4, 3 * 144), jnp.uint8)  # Q4_K rows of 3 blocks (768 values)
    GGUFLinear(blocks, Q.Q4_K, sharding=ROW, mesh=MESH)  # tp=1 splits nothing (tp=2: below)
    with pytest.raises(ValueError, match="unknown GGUF quantization type 'IQ9'"):
        GGUFLinear(blocks, "IQ9", sharding=ROW, mesh=MESH)
    with pytest.raises(ValueError, match="Q2_K is not served from its blocks"):
        GGUFLinear(blocks, Q.Q2_K, sharding=COLUMN, mesh=MESH)


TP_CHECK = """
import gguf, jax, jax.numpy as jnp, numpy as np
from jaxengine.model.layers import COLUMN, ROW
from jaxengine.model.mesh import make_mesh
from jaxengine.model.quant.gguf import GGUFEmbedder, GGUFLinear
from tests.jaxengine_kernels.test_gguf_blocks import random_rows
Q = gguf.GGMLQuantizationType
one, two = make_mesh(jax.devices()[:1]), make_mesh(jax.devices()[:2])
x = jax.random.normal(jax.random.key(0), (3, 512), jnp.float32)
for qtype in (Q.Q4_1, Q.Q4_K):
    blocks = jnp.asarray(random_rows(qtype, 8, 512))
    for sharding in (COLUMN, ROW):
        a = GGUFLinear(blocks, qtype, sharding=sharding, mesh=one)
        b = GGUFLinear(blocks, qtype, sharding=sharding, mesh=two)
        shard = b.kernel[...].addressable_shards[0].data.shape
        row = blocks.shape[1]
        assert shard == ((4, row) if sharding == COLUMN else (8, row // 2)), shard
        ya, yb = jax.jit(lambda m, x: m(x))(a, x), jax.jit(lambda m, x: m(x))(b, x)
        np.testing.assert_allclose(np.asarray(ya), np.asarray(yb), rtol=1e-5, atol=1e-5)
try:
    GGUFLinear(jnp.zeros((4, 3 * 144), jnp.uint8), Q.Q4_K, sharding=ROW, mesh=two)
    raise AssertionError("not refused")
except ValueError as e:
    assert "768 input features cannot be split over tensor_parallel_size=2" in str(e), e
emb_blocks = jnp.asarray(random_rows(Q.Q8_0, 6, 64))
ids = jnp.array([5, 0, 2], jnp.int32)
a = GGUFEmbedder(emb_blocks, Q.Q8_0, mesh=one, dtype=jnp.float32)
b = GGUFEmbedder(emb_blocks, Q.Q8_0, mesh=two, dtype=jnp.float32)
np.testing.assert_array_equal(np.asarray(a.encode(ids)), np.asarray(b.encode(ids)))
np.testing.assert_allclose(np.asarray(a.decode(x[:, :64])), np.asarray(b.decode(x[:, :64])),
                           rtol=1e-6, atol=1e-6)
print("ok")
"""


def test_on_a_mesh_of_two_the_outputs_of_one() -> None:
    assert run_python(TP_CHECK, num_devices=2).strip().endswith("ok")


@pytest.mark.parametrize("path, transposed", [
    (("layers", "self_attn", "k_proj", "kernel"), True),
    (("layers", "self_attn", "q_proj", "kernel"), True),
    (("embed_tokens", "embedding"), False), (("lm_head", "kernel"), True)])
def test_blocks_are_laid_out_as_the_floats(path: tuple, transposed: bool) -> None:
    layout = tp_layout(ModelConfig.tiny(vocab_size=126, num_kv_heads=2), 4)  # K'=4, V'=128
    rows = random_rows(Q.Q4_1, 126 if path[0] != "layers" else 2 * 8, 64)
    if path[0] == "layers":
        rows = np.stack([rows, rows[::-1]])  # two stacked layers
    floats = gguf.quants.dequantize(rows.reshape(-1, rows.shape[-1]), Q.Q4_1).reshape(
        *rows.shape[:-1], 64)
    laid = to_layout(path, rows, layout, 8, out_axis=-2)
    want = to_layout(path, np.swapaxes(floats, -1, -2) if transposed else floats, layout, 8)
    got = gguf.quants.dequantize(laid.reshape(-1, laid.shape[-1]), Q.Q4_1).reshape(
        *laid.shape[:-1], 64)
    np.testing.assert_array_equal(np.swapaxes(got, -1, -2) if transposed else got, want)


def test_made_from_the_float_modules() -> None:
    for sharding in (COLUMN, ROW):
        float_lin = linear(64, 96, sharding=sharding, mesh=MESH, dtype=jnp.bfloat16,
                           rngs=nnx.Rngs(0), use_bias=True, preferred_element_type=jnp.float32)
        lin = gguf_linear(float_lin, Q.Q4_1)
        assert lin.kernel.shape == (96, 2 * 20) and lin.kernel.dtype == jnp.uint8
        assert lin.sharding == sharding and lin.bias.shape == (96,)
        assert lin.preferred_element_type == jnp.float32
    emb = gguf_embedder(Embedder(10, 64, mesh=MESH, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)),
                        Q.Q8_0)
    assert emb.embedding.shape == (10, 2 * 34) and emb.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="rows of 48 values are not whole Q4_K blocks of 256"):
        gguf_linear(linear(48, 8, sharding=COLUMN, mesh=MESH, dtype=jnp.float32,
                           rngs=nnx.Rngs(0)), Q.Q4_K)


def test_experts_dequantize_each_projection_in_its_type() -> None:
    E, D, F = 3, 256, 512
    types = (Q.Q4_K, Q.Q8_0, Q.Q6_K)
    rows = [random_rows(t, E * o, i, seed=n, scale=1e-3).reshape(E, o, -1)
            for n, (t, (o, i)) in enumerate(zip(types, [(F, D), (F, D), (D, F)], strict=True))]
    P = jax.sharding.PartitionSpec
    experts = GGUFExperts(tuple(jnp.asarray(r) for r in rows), types, mesh=MESH,
                          gate_up_spec=P(None, None, "tp"), down_spec=P(None, "tp", None))
    specs = [spec for _, spec in experts.operands()]
    assert specs == [P(None, "tp", None), P(None, "tp", None), P(None, None, "tp")]
    got = experts.matrices(*(a for a, _ in experts.operands()), dtype=jnp.float32)
    for g, r, t in zip(got, rows, types, strict=True):
        want = gguf.quants.dequantize(r.reshape(-1, r.shape[-1]), t).reshape(E, r.shape[1], -1)
        np.testing.assert_array_equal(np.asarray(g), np.swapaxes(want, -1, -2))
