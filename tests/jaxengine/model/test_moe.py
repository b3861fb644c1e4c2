"""The sparse MoE layer against each family's routing written out in numpy (transformers'
Mixtral, Qwen2-MoE and Qwen3-MoE blocks) on random weights, on one device; the mesh checks
(tensor and expert parallel on 8 virtual CPU devices) run in a child process
(`moe_mesh_checks.py` via `tests/parallel_helpers.py`)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxengine.model.mesh import make_mesh
from jaxengine.model.moe import SparseMoE
from tests.parallel_helpers import run_pytest

MESH_CHECKS = "tests/jaxengine/model/moe_mesh_checks.py"
D = 32
# name -> SparseMoE arguments of a tiny model of the family
FAMILIES = {
    "mixtral": dict(moe_intermediate_size=48, num_experts=8, top_k=2, norm_topk_prob=True),
    "qwen2_moe": dict(moe_intermediate_size=24, num_experts=6, top_k=4, norm_topk_prob=False,
                      shared_intermediate_size=40),
    "qwen3_moe": dict(moe_intermediate_size=16, num_experts=16, top_k=4, norm_topk_prob=True),
}


def build(family: str, *, grouped_impl: str | None = None, seed: int = 0) -> SparseMoE:
    return SparseMoE(D, **FAMILIES[family], mesh=make_mesh(jax.devices()[:1]),
                     dtype=jnp.float32, rngs=nnx.Rngs(seed), grouped_impl=grouped_impl)


def numpy_moe(moe: SparseMoE, x: np.ndarray) -> np.ndarray:
    """transformers' block in float64: softmax over the router logits, top-k, renormalised
    when norm_topk_prob; each token's k experts' SwiGLU outputs, weighted and summed; plus
    sigmoid(shared_expert_gate(x)) * shared_expert(x) when there is one."""

    def swiglu(x, gate, up, down):
        g = x @ gate
        return (g / (1 + np.exp(-g)) * (x @ up)) @ down

    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    x = f64(x)
    logits = x @ f64(moe.gate.kernel[...])  # [T, E]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, : moe.top_k]  # [T, k]
    weights = np.take_along_axis(probs, chosen, axis=-1)
    if moe.norm_topk_prob:
        weights /= weights.sum(-1, keepdims=True)
    gate, up, down = (f64(p[...]) for p in (moe.experts.gate_proj, moe.experts.up_proj,
                                            moe.experts.down_proj))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(chosen[t], weights[t], strict=True):
            out[t] += w * swiglu(x[t], gate[e], up[e], down[e])
    if moe.shared_expert is not None:
        s = moe.shared_expert
        shared = swiglu(x, *(f64(p.kernel[...]) for p in (s.gate_proj, s.up_proj, s.down_proj)))
        out += shared / (1 + np.exp(-(x @ f64(moe.shared_expert_gate.kernel[...]))))
    return out


def tokens(T: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((T, D)).astype(np.float32)


@pytest.mark.parametrize("grouped_impl", ["native", "tiles", "xla"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_matches_the_family_routing_in_numpy(family: str, grouped_impl: str) -> None:
    moe = build(family, grouped_impl=grouped_impl)
    x = tokens(37, seed=1)
    np.testing.assert_allclose(np.asarray(moe(jnp.asarray(x))), numpy_moe(moe, x), atol=1e-6,
                               rtol=1e-4)


def test_router_weights_follow_norm_topk_prob() -> None:
    x = jnp.asarray(tokens(9, seed=2))
    experts, weights = build("mixtral").route(x)
    chex.assert_shape((experts, weights), (9, 2))
    np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-6)
    assert (np.asarray(weights[:, 0]) >= np.asarray(weights[:, 1])).all()
    _, weights = build("qwen2_moe").route(x)
    assert (np.asarray(weights.sum(-1)) < 1.0).all()  # 4 of 6 experts, not renormalised


@pytest.mark.parametrize("grouped_impl", ["native", "tiles", "xla"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_padding_rows_go_to_no_expert(family: str, grouped_impl: str) -> None:
    """Rows past `live` give the live rows' values unchanged, and no routed-expert output: zero
    (Mixtral), or the shared expert's alone (Qwen2-MoE)."""
    moe = build(family, grouped_impl=grouped_impl)
    x = tokens(12, seed=3)
    out = np.asarray(moe(jnp.asarray(x), jnp.int32(7)))
    np.testing.assert_allclose(out[:7], numpy_moe(moe, x[:7]), atol=1e-6, rtol=1e-4)
    if moe.shared_expert is None:
        np.testing.assert_array_equal(out[7:], 0.0)
    else:
        gate = jax.nn.sigmoid(moe.shared_expert_gate(jnp.asarray(x[7:])))
        np.testing.assert_allclose(out[7:], gate * moe.shared_expert(jnp.asarray(x[7:])),
                                   atol=1e-6, rtol=1e-5)


def test_one_compilation_for_every_routing() -> None:
    """Routing is traced: other tokens (other experts chosen) and other `live` counts reuse
    the compilation."""
    moe = build("qwen3_moe")
    graph, state = nnx.split(moe)

    @jax.jit
    @chex.assert_max_traces(n=1)  # a retrace raises inside the call
    def call(state, x, live):
        return nnx.merge(graph, state)(x, live)

    routes = []
    for seed, live in ((4, 16), (5, 16), (6, 3), (7, 0)):
        x = tokens(16, seed)
        out = np.asarray(call(state, jnp.asarray(x), jnp.int32(live)))
        np.testing.assert_allclose(out[:live], numpy_moe(moe, x[:live]), atol=1e-6, rtol=1e-4)
        routes.append(np.asarray(moe.route(jnp.asarray(x))[0]))
    assert any((r != routes[0]).any() for r in routes[1:])  # the routings did differ


@pytest.mark.parametrize(("kw", "message"), [
    (dict(top_k=9), r"num_experts_per_tok=9 must be between 1 and num_experts=8"),
    (dict(top_k=0), r"num_experts_per_tok=0 must be between 1"),
    (dict(grouped_impl="dense"), r"grouped_impl='dense' is unknown"),
])
def test_bad_sizes_are_named(kw: dict, message: str) -> None:
    args = FAMILIES["mixtral"] | kw
    with pytest.raises(ValueError, match=message):
        SparseMoE(D, **args, mesh=make_mesh(jax.devices()[:1]), dtype=jnp.float32,
                  rngs=nnx.Rngs(0))


def test_on_the_mesh_tp_and_ep_give_tp1s_output() -> None:
    """tp=2, 4, 8 with and without expert parallelism on 8 virtual CPU devices."""
    out = run_pytest([MESH_CHECKS], num_devices=8, timeout=600)
    assert " passed" in out and "failed" not in out


@pytest.mark.slow
def test_on_the_mesh_tp4() -> None:
    """The mesh checks' slow cases: tp=4 with every grouped implementation."""
    out = run_pytest([MESH_CHECKS], num_devices=8, timeout=600, args=["-m", "slow"])
    assert " passed" in out and "failed" not in out


def test_bfloat16_runs_the_cpu_default_and_stays_near_float32() -> None:
    """In bfloat16 (the native kernel is float32 only: the XLA tiles run) the layer gives the
    float32 layer's output to bfloat16 precision, but for the rare token whose routing flips on
    a rounded near-tie (hence the median)."""
    mesh = make_mesh(jax.devices()[:1])
    layers = {dtype: SparseMoE(D, **FAMILIES["qwen2_moe"], mesh=mesh, dtype=dtype,
                               rngs=nnx.Rngs(0)) for dtype in (jnp.float32, jnp.bfloat16)}
    x = jnp.asarray(tokens(40, seed=8), jnp.bfloat16)
    out = layers[jnp.bfloat16](x)
    want = np.asarray(layers[jnp.float32](x.astype(jnp.float32)))
    assert out.dtype == jnp.bfloat16
    error = np.abs(np.asarray(out, np.float32) - want).max(axis=-1)  # per token
    assert np.median(error) < 2e-2 * np.abs(want).max()
