"""The MoE layer on 8 virtual CPU devices, run in a child process by test_moe.py: jax must see
the devices from its first import, so this module is not collected by the default run (no
`test_` prefix); pytest collects it when it is named on the command line
(`tests/parallel_helpers.py`)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxengine.model.mesh import make_mesh
from jaxengine.model.moe import SparseMoE

if len(jax.devices()) < 8:
    raise RuntimeError(f"these checks need 8 devices, jax sees {len(jax.devices())}: run them "
                       "through tests/parallel_helpers.py (XLA_FLAGS=--xla_force_host_platform_"
                       "device_count=8)")

E, D, F, SHARED = 8, 32, 48, 40  # E, F and the shared width split over 8 devices
TOL = 1e-5  # float32: only the all-reduce's summation order differs


def build(tp: int, *, expert_parallel: bool, grouped_impl: str | None = None) -> SparseMoE:
    """The same weights (one seed, drawn whole, then placed) laid out over `tp` devices."""
    return SparseMoE(D, F, E, 2, norm_topk_prob=True, expert_parallel=expert_parallel,
                     shared_intermediate_size=SHARED, mesh=make_mesh(jax.devices()[:tp]),
                     dtype=jnp.float32, rngs=nnx.Rngs(0), grouped_impl=grouped_impl)


def jitted(moe: SparseMoE):
    """The layer as one jit of (state, x, live), traced at most once."""
    graph, state = nnx.split(moe)
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)  # a retrace after warm-up raises inside the call
    def call(state, x, live):
        return nnx.merge(graph, state)(x, live)

    return lambda x, live: call(state, x, live)


@pytest.fixture(scope="module")
def inputs() -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((24, D)).astype(np.float32), live) for live in (24, 17, 24)]


@pytest.fixture(scope="module")
def tp1(inputs) -> list[np.ndarray]:
    call = jitted(build(1, expert_parallel=False))
    return [np.asarray(call(jnp.asarray(x), jnp.int32(live))) for x, live in inputs]


# Every grouped implementation at tp=2, the default one (native) at tp=8 too; the rest run with
# -m slow (tp=4 adds no layout case that 2 and 8 lack: both split E and F evenly).
SLOW = pytest.mark.slow


@pytest.mark.parametrize(("tp", "grouped_impl"), [
    (2, "native"), (2, "tiles"), (2, "xla"), (8, "native"),
    pytest.param(8, "tiles", marks=SLOW), pytest.param(8, "xla", marks=SLOW),
    pytest.param(4, "native", marks=SLOW), pytest.param(4, "tiles", marks=SLOW),
    pytest.param(4, "xla", marks=SLOW)])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_gives_tp1s_output_and_compiles_once(tp: int, expert_parallel: bool, grouped_impl: str,
                                             inputs, tp1) -> None:
    call = jitted(build(tp, expert_parallel=expert_parallel, grouped_impl=grouped_impl))
    for (x, live), want in zip(inputs, tp1, strict=True):
        out = call(jnp.asarray(x), jnp.int32(live))
        np.testing.assert_allclose(np.asarray(out), want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_expert_weights_are_split(tp: int) -> None:
    """Each device holds E/tp whole experts with expert parallelism, else every expert's F/tp
    slice; the router is whole on every device."""
    for expert_parallel, gate_up, down in (
            (True, (E // tp, D, F), (E // tp, F, D)),
            (False, (E, D, F // tp), (E, F // tp, D))):
        moe = build(tp, expert_parallel=expert_parallel)
        ex = moe.experts
        for param, shape in ((ex.gate_proj, gate_up), (ex.up_proj, gate_up),
                             (ex.down_proj, down)):
            shards = param[...].addressable_shards
            assert len(shards) == tp and {s.data.shape for s in shards} == {shape}
        assert {s.data.shape for s in moe.gate.kernel[...].addressable_shards} == {(D, E)}


def test_expert_parallel_refuses_experts_the_devices_cannot_split() -> None:
    with pytest.raises(ValueError, match=r"enable_expert_parallel splits num_experts=6 over "
                                         r"tensor_parallel_size=4"):
        SparseMoE(D, F, 6, 2, norm_topk_prob=True, expert_parallel=True,
                  mesh=make_mesh(jax.devices()[:4]), dtype=jnp.float32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 does not divide the model's "
                                         r"moe_intermediate_size=12"):
        SparseMoE(D, 12, E, 2, norm_topk_prob=True, mesh=make_mesh(jax.devices()[:8]),
                  dtype=jnp.float32, rngs=nnx.Rngs(0))
    # with expert parallelism the experts stay whole: F need not divide
    SparseMoE(D, 12, E, 2, norm_topk_prob=True, expert_parallel=True,
              mesh=make_mesh(jax.devices()[:8]), dtype=jnp.float32, rngs=nnx.Rngs(0))
