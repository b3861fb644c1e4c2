"""The kernels against the reference: the Pallas kernels (TPU interpreter / Triton interpreter
on CPU) and the native CPU kernel (compiled, run for real).

Every batch has shuffled block tables, NaN in unused pages and padding tokens. The default run
covers a reduced grid at tiny shapes (interpret mode is slow); ``-m slow`` runs the full grid:
decode-only / prefill-only / mixed / long (contexts up to 2k) x page sizes 16, 32 x head_dim
64, 128 x GQA ratios 1, 3, 8 x float32, bfloat16.
"""

from __future__ import annotations

import dataclasses
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from jaxengine_kernels import (
    UnsupportedShapeError,
    check_supported,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from jaxengine_kernels.cpu import ragged_paged_attention_cpu
from jaxengine_kernels.gpu.kernel import ragged_paged_attention_gpu
from jaxengine_kernels.tpu.kernel import ragged_paged_attention_tpu
from tests.jaxengine_kernels.cases import assert_cache_equal, make_case, numpy_oracle

# (q_len, context_len) per request.
BATCHES = {
    "decode": [(1, 40), (1, 17), (1, 1), (1, 95)],
    "prefill": [(23, 23), (40, 40), (9, 9)],
    "mixed": [(1, 33), (20, 20), (9, 70), (1, 2), (3, 16)],
    "long": [(1, 2000), (48, 1100), (1, 700), (5, 5)],
}
HEADS = {1: (2, 2), 3: (6, 2), 8: (8, 1)}  # GQA ratio -> (q heads, kv heads)
TOL = {"float32": 2e-5, "bfloat16": 3e-2}
# Small blocks so that tiny batches still cross q-block, kv-block and split boundaries.
BLOCKS = {
    "cpu": {"block_q": 4, "pages_per_split": 2},
    "tpu": {"block_q": 8, "pages_per_block": 2},
    "gpu": {"num_splits": 3},
}
KERNELS = {"cpu": ragged_paged_attention_cpu, "tpu": ragged_paged_attention_tpu,
           "gpu": ragged_paged_attention_gpu}

# (impl, batch, page_size, head_dim, gqa, dtype)
REDUCED = [
    (impl, *params)
    for impl in ("cpu", "tpu", "gpu")
    for params in [
        ("mixed", 16, 64, 3, "float32"),
        ("decode", 32, 128, 8, "bfloat16"),
        ("prefill", 16, 64, 1, "bfloat16"),
        ("mixed", 32, 64, 8, "bfloat16"),
    ]
]
FULL = [
    (impl, *params)
    for impl in ("cpu", "tpu", "gpu")
    for params in itertools.product(BATCHES, (16, 32), (64, 128), HEADS, TOL)
    if (impl, *params) not in REDUCED
]


def check_against_reference(impl, batch, page_size, head_dim, gqa, dtype_name, **blocks):
    num_heads, num_kv_heads = HEADS[gqa]
    case = make_case(BATCHES[batch], num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, page_size=page_size, seed=page_size + gqa)  # fmt: skip
    dtype = jnp.dtype(dtype_name)
    args = case.args(dtype)
    out, cache = KERNELS[impl](*args, sm_scale=case.sm_scale, interpret=True, **blocks)
    ref_out, ref_cache = ragged_paged_attention_reference(*args, sm_scale=case.sm_scale)
    want_out, want_cache = numpy_oracle(case, dtype)
    T, tol = case.num_tokens, TOL[dtype_name]
    chex.assert_type([out, cache], dtype)
    chex.assert_shape([out, cache], [case.q.shape, case.kv_cache.shape])
    out = np.asarray(out.astype(jnp.float32))[:T]
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, want_out, atol=tol, rtol=tol)
    np.testing.assert_allclose(out, np.asarray(ref_out.astype(jnp.float32))[:T], atol=tol, rtol=tol)
    assert_cache_equal(np.asarray(cache.astype(jnp.float32)), want_cache)
    assert_cache_equal(np.asarray(cache.astype(jnp.float32)),
                       np.asarray(ref_cache.astype(jnp.float32)))  # fmt: skip


@pytest.mark.parametrize(("impl", "batch", "page_size", "head_dim", "gqa", "dtype"), REDUCED)
def test_kernel_matches_reference(impl, batch, page_size, head_dim, gqa, dtype):
    check_against_reference(impl, batch, page_size, head_dim, gqa, dtype, **BLOCKS[impl])


@pytest.mark.slow
@pytest.mark.parametrize(("impl", "batch", "page_size", "head_dim", "gqa", "dtype"), FULL)
def test_kernel_matches_reference_full_grid(impl, batch, page_size, head_dim, gqa, dtype):
    check_against_reference(impl, batch, page_size, head_dim, gqa, dtype, **BLOCKS[impl])


@pytest.mark.parametrize("impl", ["cpu", "tpu", "gpu"])
def test_default_block_sizes(impl):
    check_against_reference(impl, "mixed", 16, 64, 3, "float32")


@pytest.mark.parametrize("impl", ["cpu", "tpu", "gpu"])
def test_dispatcher_runs_the_kernel_under_jit(impl):
    case = make_case(BATCHES["mixed"], num_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    chex.clear_trace_counter()  # the counter is keyed by source: both impls share it

    @jax.jit
    @chex.assert_max_traces(n=1)  # the second call, with the step's own cache, must not retrace
    def f(*a):
        return ragged_paged_attention(*a, sm_scale=case.sm_scale, impl=impl, interpret=True,
                                      **BLOCKS[impl])  # fmt: skip

    out, cache = f(*case.args(jnp.float32))
    want, _ = numpy_oracle(case)
    np.testing.assert_allclose(np.asarray(out)[: case.num_tokens], want, atol=2e-5, rtol=2e-5)
    f(*case.args(jnp.float32)[:3], cache, *case.args(jnp.float32)[4:])  # the step's cache back


@pytest.mark.parametrize(("impl", "match"), [("tpu", "multiple of 64"), ("gpu", "power of two")])
def test_unsupported_shape_is_an_error_not_a_fallback(impl, match):
    case = make_case(BATCHES["mixed"], num_heads=4, num_kv_heads=2, head_dim=24, page_size=4)
    args = case.args(jnp.float32)
    with pytest.raises(UnsupportedShapeError, match=f"head_dim must be a {match}.*got 24") as e:
        jax.jit(lambda *a: ragged_paged_attention(
            *a, sm_scale=case.sm_scale, impl=impl, interpret=True))(*args)  # fmt: skip
    assert (e.value.field, e.value.value) == ("head_dim", 24)


@pytest.mark.parametrize(
    ("impl", "shape", "field", "value"),
    [
        ("tpu", dict(head_dim=96, page_size=16), "head_dim", 96),
        ("tpu", dict(head_dim=128, page_size=12), "page_size", 12),
        ("gpu", dict(head_dim=8, page_size=16), "head_dim", 8),
        ("gpu", dict(head_dim=128, page_size=24), "page_size", 24),
    ],
)
def test_check_supported_names_the_parameter(impl, shape, field, value):
    with pytest.raises(UnsupportedShapeError, match=f"{field} must be .*got {value}") as e:
        check_supported(impl, num_heads=32, num_kv_heads=8, **shape)
    assert (e.value.field, e.value.value) == (field, value)


@pytest.mark.parametrize("impl", ["reference", "cpu", "tpu", "gpu"])
def test_check_supported_accepts_common_models(impl):
    # Llama-3-8B, SmolLM2-135M, Qwen2.5-0.5B, Gemma-7B
    for heads, head_dim in (((32, 8), 128), ((9, 3), 64), ((14, 2), 64), ((16, 16), 256)):
        check_supported(impl, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                        page_size=16)  # fmt: skip


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_bad_head_layout_is_a_plain_value_error(impl):
    case = make_case(BATCHES["decode"], num_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    q, *rest = case.args(jnp.float32)
    with pytest.raises(ValueError, match="bad head layout") as e:  # 3 query heads, 2 kv heads
        ragged_paged_attention(q[:, :3], *rest, sm_scale=1.0, impl=impl, interpret=True)
    assert not isinstance(e.value, UnsupportedShapeError)


@pytest.mark.parametrize(
    ("impl", "device_kind", "platform", "custom_call"),
    [
        ("tpu", "TPU v6 lite", "tpu", "tpu_custom_call"),
        ("gpu", "NVIDIA H200", "cuda", "__gpu$xla.gpu.triton"),
    ],
)
def test_lowers_for_the_accelerator(impl, device_kind, platform, custom_call):
    """Lowering to Mosaic / Triton IR runs on CPU for an abstract device (no compile)."""
    case = make_case(BATCHES["mixed"], num_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    f = jax.jit(lambda *a: KERNELS[impl](*a, sm_scale=case.sm_scale))
    device = AbstractDevice(device_kind=device_kind, num_cores=1, platform=platform.replace(
        "cuda", "gpu"))  # fmt: skip
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    args = case.args(jnp.bfloat16)  # concrete arrays, made outside the abstract mesh
    with jax.sharding.use_abstract_mesh(mesh):
        text = f.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert custom_call in text


@pytest.mark.parametrize("impl", ["reference", "cpu", "tpu", "gpu"])
def test_nan_in_padding_tokens_does_not_leak(impl):
    """Padding rows of q/k/v (written into block 0) may be NaN; live rows stay exact."""
    case = make_case(BATCHES["mixed"], num_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    T = case.num_tokens
    q, k, v = (a.copy() for a in (case.q, case.k, case.v))
    for a in (q, k, v):
        a[T:] = np.nan
    case = dataclasses.replace(case, q=q, k=k, v=v)
    blocks = BLOCKS.get(impl, {})
    out, cache = ragged_paged_attention(
        *case.args(jnp.float32), sm_scale=case.sm_scale, impl=impl, interpret=True, **blocks
    )
    want, want_cache = numpy_oracle(case)
    np.testing.assert_allclose(np.asarray(out)[:T], want, atol=2e-5, rtol=2e-5)
    assert_cache_equal(np.asarray(cache), want_cache)
