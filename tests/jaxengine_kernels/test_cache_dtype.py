"""Quantized KV caches (float32, bfloat16, fp8 e4m3fn / e5m2 with per-tensor scales) in every
implementation: writes quantize, reads dequantize (``jaxengine_kernels.cache_dtype``).

Each implementation's output equals the numpy oracle run on the values the quantized cache
stands for (tight), and is close to the float32 cache's result (loose, but scales that were
ignored or inverted would break it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from jaxengine_kernels import (
    UnsupportedShapeError,
    check_supported,
    gpu,
    ragged_paged_attention,
    tpu,
    write_kv,
)
from jaxengine_kernels.cache_dtype import dequantize, quantize
from tests.jaxengine_kernels.cases import Case, make_case, numpy_oracle

CACHE_DTYPES = ("float32", "bfloat16", "float8_e4m3fn", "float8_e5m2")
IMPLS = ("reference", "cpu", "tpu", "gpu")
BLOCKS = {
    "reference": {"block_q": 4, "pages_per_chunk": 2, "decode_pages_per_step": 3},
    "cpu": {"block_q": 4, "pages_per_split": 2},
    "tpu": {"block_q": 8, "pages_per_block": 2},
    "gpu": {"num_splits": 3},
}
# Shapes every kernel runs (TPU: head_dim % 64, page_size % 8; GPU: powers of two).
SHAPES = dict(num_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
BATCH = [(1, 33), (20, 20), (9, 70), (1, 2), (3, 16)]  # (q_len, context) per request
DECODES = [(1, 33), (1, 70), (1, 16), (1, 51)]  # the context read is mostly cached
# Keys small and values large, so that without their scales (0.5 and 2) fp8 would lose the keys'
# precision and saturate the values; the scales bring both into the format's well-kept range.
K_SCALE, V_SCALE = 0.5, 2.0
K_MAG, V_MAG = 0.5, 300.0


def scaled_case(seed: int = 0, batch: list[tuple[int, int]] = BATCH, **kw) -> Case:
    """A batch whose keys are ~K_MAG and values ~V_MAG (cached and new)."""
    case = make_case(batch, **SHAPES, seed=seed, **kw)
    kv = case.kv_cache.copy()
    kv[:, :, 0::2] *= K_MAG
    kv[:, :, 1::2] *= V_MAG
    return dataclasses.replace(case, k=case.k * K_MAG, v=case.v * V_MAG, kv_cache=kv)


def quantized_args(case: Case, q_dtype, cache_dtype, k_scale: float, v_scale: float):
    """The kernel's arguments with the cache quantized, and the case of the values they stand
    for (what the oracle must see): q, k, v rounded to ``q_dtype``, the cache and the new K/V
    as ``dequantize(quantize(x))``."""
    args = case.args(q_dtype)
    q, k, v, kv = args[:4]
    kv32 = jnp.asarray(case.kv_cache)
    scales = jnp.array([k_scale, v_scale], jnp.float32)[jnp.arange(kv.shape[2]) % 2][:, None]
    kv_q = quantize(kv32, scales, cache_dtype)  # K slots by k_scale, V slots by v_scale
    ks, vs = jnp.float32(k_scale), jnp.float32(v_scale)
    stands_for = dataclasses.replace(
        case,
        q=np.asarray(q.astype(jnp.float32)),
        k=np.asarray(dequantize(quantize(k, ks, cache_dtype), ks)),
        v=np.asarray(dequantize(quantize(v, vs, cache_dtype), vs)),
        kv_cache=np.asarray(dequantize(kv_q, scales)),
    )
    return (q, k, v, kv_q, *args[4:]), stands_for


def run(impl, args, case, **kw):
    out, cache = ragged_paged_attention(*args, sm_scale=case.sm_scale, impl=impl,
                                        interpret=True, **BLOCKS[impl], **kw)  # fmt: skip
    return np.asarray(out.astype(jnp.float32))[: case.num_tokens], cache


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
def test_reads_the_values_the_quantized_cache_stands_for(impl, cache_dtype, q_dtype):
    case = scaled_case()
    args, stands_for = quantized_args(case, q_dtype, cache_dtype, K_SCALE, V_SCALE)
    out, cache = run(impl, args, case, k_scale=K_SCALE, v_scale=V_SCALE)
    assert cache.dtype == jnp.dtype(cache_dtype)
    want, want_cache = numpy_oracle(stands_for)
    tol = 2e-5 if q_dtype == "float32" else 2e-2
    np.testing.assert_allclose(out / V_MAG, want / V_MAG, atol=tol, rtol=tol)
    # The new K/V are written quantized: the cache stands for the oracle's (block 0 aside).
    got_cache = np.asarray(dequantize(cache, jnp.array([K_SCALE, V_SCALE])[
        jnp.arange(cache.shape[2]) % 2][:, None]))  # fmt: skip
    np.testing.assert_array_equal(got_cache[1:], want_cache[1:])


# Mean |error| / mean |out| of the quantized cache's output against the float32 cache's: fp8's
# 3 (e4m3) or 2 (e5m2) mantissa bits; a scale ignored on write or read is off by 2x somewhere.
# (Measured: 1e-7, 2e-3, 0.03 and 0.05; 0.17 for e4m3 unscaled, whose values saturate.)
LOOSE = {"float32": 1e-6, "bfloat16": 5e-3, "float8_e4m3fn": 0.05, "float8_e5m2": 0.1}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_close_to_the_float32_cache(impl, cache_dtype):
    # A clean cache: the same context in every dtype.
    case = scaled_case(seed=1, batch=DECODES, garbage=None)
    exact, _ = numpy_oracle(case)
    args, _ = quantized_args(case, "float32", cache_dtype, K_SCALE, V_SCALE)
    out, _ = run(impl, args, case, k_scale=K_SCALE, v_scale=V_SCALE)
    error = np.abs(out - exact).mean() / np.abs(exact).mean()
    assert error < LOOSE[cache_dtype]
    # The bound is tight enough to see a wrong scale: the cached keys read at 1 are doubled,
    # the cached values halved.
    for scales in (dict(k_scale=1.0, v_scale=V_SCALE), dict(k_scale=K_SCALE, v_scale=1.0)):
        wrong, _ = run(impl, args, case, **scales)
        assert np.abs(wrong - exact).mean() / np.abs(exact).mean() > 0.3


@pytest.mark.parametrize("cache_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_write_saturates(cache_dtype):
    """Beyond the format's range (scale 1) reads back as its largest finite value."""
    top = float(jnp.finfo(cache_dtype).max)
    cache = jnp.zeros((2, 4, 2, 3), cache_dtype)  # P=2, L=4, K=1, H=3
    k = jnp.array([[[1e9, -1e9, 1.0]]], jnp.float32)
    v = jnp.array([[[2 * top, -3 * top, jnp.inf]]], jnp.float32)
    cache = write_kv(cache, k, v, jnp.array([5], jnp.int32))
    np.testing.assert_array_equal(np.asarray(cache[1, 1].astype(jnp.float32)),
                                  [[top, -top, 1.0], [top, -top, top]])  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cache_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_with_sliding_window_and_soft_cap(impl, cache_dtype):
    case = scaled_case(seed=2, sliding_window=6)
    args, stands_for = quantized_args(case, "float32", cache_dtype, K_SCALE, V_SCALE)
    out, _ = run(impl, args, case, k_scale=K_SCALE, v_scale=V_SCALE, sliding_window=6,
                 soft_cap=1.5)  # fmt: skip
    want, _ = numpy_oracle(stands_for, sliding_window=6, soft_cap=1.5)
    np.testing.assert_allclose(out / V_MAG, want / V_MAG, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_traced_scales_under_jit(impl):
    """Scales are operands: new values reuse the compilation and change the result."""
    case = scaled_case(seed=3)
    args, stands_for = quantized_args(case, "float32", "float8_e4m3fn", K_SCALE, V_SCALE)
    f = jax.jit(lambda ks, vs, *a: ragged_paged_attention(
        *a, sm_scale=case.sm_scale, impl=impl, interpret=True, k_scale=ks, v_scale=vs,
        **BLOCKS[impl]))  # fmt: skip
    out, _ = f(jnp.float32(K_SCALE), jnp.float32(V_SCALE), *args)
    want, _ = numpy_oracle(stands_for)
    T = case.num_tokens
    np.testing.assert_allclose(np.asarray(out)[:T] / V_MAG, want / V_MAG, atol=2e-5, rtol=2e-5)
    out2, _ = f(jnp.float32(K_SCALE), jnp.float32(2 * V_SCALE), *args)
    assert f._cache_size() == 1
    # Doubling v_scale doubles what the cached values stand for (the new tokens', written at
    # the doubled scale, stand for what they did): most outputs nearly double.
    assert not np.allclose(np.asarray(out2)[:T], np.asarray(out)[:T], rtol=0.1)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(k_scale=0.0), "k_scale must be a positive finite float, got 0.0"),
        (dict(v_scale=float("nan")), "v_scale must be a positive finite float, got nan"),
    ],
)
def test_bad_scale_is_an_error(kw, match):
    case = make_case(BATCH, **SHAPES)
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(*case.args(jnp.float32), sm_scale=1.0, **kw)


def test_bad_dtypes_are_errors():
    case = make_case(BATCH, **SHAPES)
    q, k, v, kv, *meta = case.args(jnp.float32)
    with pytest.raises(ValueError, match="kv_cache dtype must be one of float32, bfloat16, "
                                         "float8_e4m3fn, float8_e5m2, got int8"):
        ragged_paged_attention(q, k, v, kv.astype(jnp.int8), *meta, sm_scale=1.0)
    with pytest.raises(ValueError, match="q must be float32 or bfloat16, got float16"):
        ragged_paged_attention(q.astype(jnp.float16), k, v, kv, *meta, sm_scale=1.0)


@pytest.mark.parametrize(
    ("check", "device", "cache_dtype", "refused"),
    [
        (tpu.check_cache_dtype, "TPU v5 lite", "float8_e4m3fn", True),
        (tpu.check_cache_dtype, "TPU v4", "float8_e5m2", True),
        (tpu.check_cache_dtype, "TPU v5 lite", "bfloat16", False),
        (tpu.check_cache_dtype, "TPU v6 lite", "float8_e4m3fn", False),
        (gpu.check_cache_dtype, "8.0", "float8_e4m3fn", True),
        (gpu.check_cache_dtype, "8.0", "float8_e5m2", False),
        (gpu.check_cache_dtype, "9.0", "float8_e4m3fn", False),
    ],
)
def test_a_platform_that_cannot_hold_fp8_refuses_it(check, device, cache_dtype, refused):
    if not refused:
        check(cache_dtype, device)
        return
    with pytest.raises(UnsupportedShapeError, match=f"kv_cache_dtype must be .*{device}.*got "
                                                    f"{cache_dtype}") as e:  # fmt: skip
        check(cache_dtype, device)
    assert (e.value.field, e.value.value) == ("kv_cache_dtype", cache_dtype)


@pytest.mark.parametrize("impl", ["reference", "cpu", "tpu", "gpu"])
def test_check_supported_takes_the_cache_dtype(impl):
    # On this CPU every kernel holds every cache dtype (the Pallas ones in interpret mode).
    for cache_dtype in CACHE_DTYPES:
        check_supported(impl, **SHAPES, kv_cache_dtype=cache_dtype)
    with pytest.raises(ValueError, match="kv_cache dtype must be one of .*got float16"):
        check_supported(impl, **SHAPES, kv_cache_dtype=jnp.float16)


@pytest.mark.parametrize("cache_dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize(
    ("impl", "device_kind", "platform", "custom_call"),
    [
        ("tpu", "TPU v6 lite", "tpu", "tpu_custom_call"),
        ("gpu", "NVIDIA H200", "cuda", "__gpu$xla.gpu.triton"),
    ],
)
def test_fp8_lowers_for_the_accelerator(impl, device_kind, platform, custom_call, cache_dtype):
    """Lowering to Mosaic / Triton IR with an fp8 cache, on CPU for an abstract device."""
    case = make_case(BATCH, num_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    f = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=case.sm_scale, impl=impl,
                                                  k_scale=K_SCALE, v_scale=V_SCALE))
    device = AbstractDevice(device_kind=device_kind, num_cores=1, platform=platform.replace(
        "cuda", "gpu"))  # fmt: skip
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    args = list(case.args(jnp.bfloat16))  # concrete arrays, made outside the abstract mesh
    args[3] = args[3].astype(cache_dtype)
    with jax.sharding.use_abstract_mesh(mesh):
        text = f.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert custom_call in text


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cache_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_every_fp8_value_reads_back_exactly(impl, cache_dtype):
    """Two one-token requests without context: each attends to its own key alone, so its
    output is its value as written and read back. The values are the format's 256 (NaN
    included; inf saturates on writing, as any value beyond the range) times v_scale."""
    case = make_case([(1, 1), (1, 1)], **SHAPES)
    T, K, H = case.v.shape
    every = np.arange(256, dtype=np.uint8).view(jnp.dtype(cache_dtype)).astype(np.float32)
    v = case.v.copy()
    v[:2] = every.reshape(2, K, H) * V_SCALE
    case = dataclasses.replace(case, v=v)
    out, _ = run(impl, case.args(jnp.float32)[:3] + (
        jnp.asarray(case.kv_cache).astype(cache_dtype), *case.args(jnp.float32)[4:]), case,
        k_scale=K_SCALE, v_scale=V_SCALE)  # fmt: skip
    top = float(jnp.finfo(cache_dtype).max)
    want = np.where(np.isinf(every), np.sign(every) * top, every) * V_SCALE
    G = SHAPES["num_heads"] // K
    np.testing.assert_array_equal(out, np.repeat(want.reshape(2, K, 1, H), G, axis=2)
                                  .reshape(2, K * G, H))  # fmt: skip
