"""Sliding windows and soft-capping in every implementation, against a dense numpy oracle.

A query at position p sees the keys p - W < k <= p (``sliding_window`` W; 0: all k <= p), and
with ``soft_cap`` c its scores are c * tanh(q.k * sm_scale / c) before the mask. Every slot
before the first key the step's earliest query of a request sees holds NaN
(``make_case(sliding_window=W)``): whole pages among them, as the scheduler hands pages that
slid out of every window to other requests. An implementation that reads them into its sums
instead of skipping them (or that masks by a multiply) gives NaN.

The window is an operand: one compiled function serves every W, under ``jax.jit`` with W an
argument and inside a ``lax.scan`` over layers with a window each.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from jaxengine_kernels import ragged_paged_attention
from jaxengine_kernels.gpu.kernel import ragged_paged_attention_gpu
from jaxengine_kernels.tpu.kernel import ragged_paged_attention_tpu
from tests.jaxengine_kernels.cases import Case, assert_cache_equal, make_case, numpy_oracle

# (q_len, context_len): decodes, whole prefills, a mix, and chunks after a cached prefix.
BATCHES = {
    "decode": [(1, 40), (1, 17), (1, 1), (1, 95)],
    "prefill": [(23, 23), (40, 40), (9, 9)],
    "mixed": [(1, 33), (20, 20), (9, 70), (1, 2), (3, 16)],
    "chunked": [(9, 70), (24, 100), (2, 81), (1, 64)],
}
WINDOWS = [0, 1, 5, 16, 1000]
CAPS = [None, 0.5]
# Small blocks so that tiny batches cross q-block, kv-block and split boundaries.
IMPLS = {
    "reference": {"block_q": 8, "pages_per_chunk": 1, "decode_pages_per_step": 2},
    "cpu": {"block_q": 4, "pages_per_split": 2},
    "tpu": {"block_q": 8, "pages_per_block": 2},
    "gpu": {"num_splits": 3},
}
TOL = {"float32": 2e-5, "bfloat16": 3e-2}


def _case(batch: str, window: int, seed: int = 0, garbage: float = np.nan) -> Case:
    return make_case(BATCHES[batch], num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                     seed=seed, sliding_window=window, garbage=garbage)  # fmt: skip


def _check(impl: str, case: Case, window: int, soft_cap: float | None, dtype: str) -> None:
    out, cache = ragged_paged_attention(
        *case.args(jnp.dtype(dtype)), sm_scale=case.sm_scale, sliding_window=window,
        soft_cap=soft_cap, impl=impl, interpret=True, **IMPLS[impl],
    )  # fmt: skip
    want, want_cache = numpy_oracle(case, jnp.dtype(dtype), sliding_window=window,
                                    soft_cap=soft_cap)  # fmt: skip
    out = np.asarray(out.astype(jnp.float32))[: case.num_tokens]
    assert np.isfinite(out).all(), f"rows {np.flatnonzero(~np.isfinite(out).all(axis=(1, 2)))}"
    np.testing.assert_allclose(out, want, atol=TOL[dtype], rtol=TOL[dtype])
    assert_cache_equal(np.asarray(cache.astype(jnp.float32)), want_cache)


@pytest.mark.parametrize("soft_cap", CAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("impl", IMPLS)
def test_window_and_cap_match_the_oracle(impl, batch, window, soft_cap):
    _check(impl, _case(batch, window), window, soft_cap, "float32")


@pytest.mark.parametrize("garbage", [np.inf, -np.inf])
@pytest.mark.parametrize("impl", IMPLS)
def test_infinities_before_the_windows_do_not_leak(impl, garbage):
    """Inf - Inf and 0 * Inf are NaN: a kernel that reads those slots and masks by arithmetic
    fails this."""
    _check(impl, _case("chunked", 16, garbage=garbage), 16, 0.5, "float32")


@pytest.mark.parametrize("impl", IMPLS)
def test_window_and_cap_in_bfloat16(impl):
    _check(impl, _case("chunked", 16), 16, 0.5, "bfloat16")


@pytest.mark.parametrize("impl", IMPLS)
def test_a_cap_large_against_the_scores_is_nearly_none(impl):
    """Scores far under the cap take the CPU kernel's tanh series (|s / cap| < 1/8)."""
    _check(impl, _case("mixed", 5), 5, 50.0, "float32")


def test_the_cases_have_whole_pages_of_nan_before_the_windows():
    """What the tests above rely on: whole pages a request owns are NaN where W is short."""
    case = _case("chunked", 5)
    for r, (q_len, s) in enumerate(BATCHES["chunked"]):
        first = max(s - q_len - 5 + 1, 0)  # the first key the request's first query sees
        pages = case.block_tables[r, : first // 16]
        if r < 3:  # contexts 70, 100, 81: the windows start past page 3
            assert len(pages) >= 3
        assert np.isnan(case.kv_cache[pages]).all()
        assert not np.isnan(case.kv_cache[case.block_tables[r, (s - q_len - 1) // 16]]).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_traced_window_compiles_once(impl):
    """W as an argument of a jitted function: two windows, one trace."""
    case = _case("chunked", 16)  # NaN before the 16-key windows, so before the 5-key ones too
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(window, *a):
        return ragged_paged_attention(*a, sm_scale=case.sm_scale, sliding_window=window,
                                      soft_cap=0.5, impl=impl, interpret=True, **IMPLS[impl])

    for window in (16, 5):
        out, _ = f(jnp.int32(window), *case.args(jnp.float32))
        want, _ = numpy_oracle(case, sliding_window=window, soft_cap=0.5)
        np.testing.assert_allclose(np.asarray(out)[: case.num_tokens], want, atol=2e-5,
                                   rtol=2e-5)  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
def test_a_scan_over_layers_gives_each_its_window(impl):
    """Gemma's layout: a local layer (W = 5) and a global one (W = 0) in one lax.scan, the
    windows as scanned operands, each layer with its own cache (NaN before the local layer's
    windows)."""
    windows = (5, 0)
    cases = [_case("mixed", w) for w in windows]  # one seed: the same batch, other garbage
    q, k, v, _, *meta = cases[0].args(jnp.float32)
    caches = jnp.stack([c.args(jnp.float32)[3] for c in cases])  # [Ly, P, L, 2*K, H]

    def layer(_, xs):
        cache, window = xs
        out, cache = ragged_paged_attention(
            q, k, v, cache, *meta, sm_scale=cases[0].sm_scale, sliding_window=window,
            impl=impl, interpret=True, **IMPLS[impl],
        )  # fmt: skip
        return None, (out, cache)

    _, (outs, _) = jax.jit(lambda c, w: jax.lax.scan(layer, None, (c, w)))(
        caches, jnp.asarray(windows, jnp.int32))
    for out, window, case in zip(outs, windows, cases, strict=True):
        want, _ = numpy_oracle(case, sliding_window=window)
        np.testing.assert_allclose(np.asarray(out)[: case.num_tokens], want, atol=2e-5,
                                   rtol=2e-5)  # fmt: skip
    assert not np.allclose(outs[0], outs[1])


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(sliding_window=-1), "sliding_window must be >= 0.*got -1"),
    (dict(soft_cap=0.0), "soft_cap must be a positive float or None, got 0.0"),
    (dict(soft_cap=-30.0), "soft_cap must be a positive float or None, got -30.0"),
])
def test_a_bad_window_or_cap_is_an_error_naming_it(kwargs, match):
    case = _case("decode", 0)
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(*case.args(jnp.float32), sm_scale=case.sm_scale, **kwargs)


@pytest.mark.parametrize(
    ("kernel", "device_kind", "platform", "custom_call"),
    [
        (ragged_paged_attention_tpu, "TPU v6 lite", "tpu", "tpu_custom_call"),
        (ragged_paged_attention_gpu, "NVIDIA H200", "cuda", "__gpu$xla.gpu.triton"),
    ],
)
def test_a_traced_window_and_a_cap_lower_for_the_accelerator(kernel, device_kind, platform,
                                                              custom_call):
    """Lowering to Mosaic / Triton IR (on CPU, for an abstract device) with the window an
    argument and the cap's tanh in the kernel body."""
    case = make_case(BATCHES["chunked"], num_heads=32, num_kv_heads=8, head_dim=128,
                     page_size=16)  # fmt: skip
    f = jax.jit(lambda w, *a: kernel(*a, sm_scale=case.sm_scale, sliding_window=w, soft_cap=50.0))
    device = AbstractDevice(device_kind=device_kind, num_cores=1,
                            platform=platform.replace("cuda", "gpu"))  # fmt: skip
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    args = (jnp.int32(512), *case.args(jnp.bfloat16))
    with jax.sharding.use_abstract_mesh(mesh):
        text = f.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert custom_call in text
