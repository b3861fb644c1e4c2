"""An fp8 KV cache stored as its bits (uint8) on the CPU path (``cache_dtype.storage_dtype``):
the same outputs and bytes as the fp8 array, a write that updates the donated cache in place,
and clear refusals."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine_kernels import ragged_paged_attention
from jaxengine_kernels.cache_dtype import storage_dtype
from tests.jaxengine_kernels.test_cache_dtype import (
    K_SCALE,
    V_SCALE,
    quantized_args,
    run,
    scaled_case,
)

FP8 = ("float8_e4m3fn", "float8_e5m2")
BITS_IMPLS = ("reference", "cpu")


@pytest.mark.parametrize("impl", BITS_IMPLS)
@pytest.mark.parametrize("cache_dtype", FP8)
def test_bits_give_the_fp8_caches_outputs_and_bytes(impl: str, cache_dtype: str) -> None:
    case = scaled_case()  # unused pages hold NaN
    args, _ = quantized_args(case, "float32", cache_dtype, K_SCALE, V_SCALE)
    bits = jax.lax.bitcast_convert_type(args[3], jnp.uint8)
    out, cache = run(impl, args, case, k_scale=K_SCALE, v_scale=V_SCALE)
    out_bits, cache_bits = run(impl, (*args[:3], bits, *args[4:]), case, k_scale=K_SCALE,
                               v_scale=V_SCALE, kv_cache_dtype=jnp.dtype(cache_dtype))
    assert cache_bits.dtype == jnp.uint8
    np.testing.assert_array_equal(out_bits, out)
    # The same values (XLA's whole-array fp8 scatter may rewrite a NaN's payload)...
    np.testing.assert_array_equal(
        np.asarray(cache_bits).view(jnp.dtype(cache_dtype)).astype(np.float32),
        np.asarray(cache).astype(np.float32))
    # ...and byte for byte: the new rows' bytes, every other byte untouched.
    written = np.zeros(bits.shape[:2], bool).reshape(-1)
    written[np.asarray(case.args("float32")[4])] = True
    written = written.reshape(bits.shape[:2])
    new = np.asarray(jax.lax.bitcast_convert_type(cache, jnp.uint8))
    np.testing.assert_array_equal(np.asarray(cache_bits)[written], new[written])
    np.testing.assert_array_equal(np.asarray(cache_bits)[~written], np.asarray(bits)[~written])


def _compiled(impl: str, stored: jnp.dtype, values: jnp.dtype | None) -> str:
    """The optimized HLO of the op jitted with a donated [P, L, 2K, H] cache of ``stored``."""
    P, L, K, H, N, T, R = 64, 16, 2, 64, 4, 8, 4
    f32, i32 = jnp.float32, jnp.int32
    S = jax.ShapeDtypeStruct
    f = jax.jit(functools.partial(ragged_paged_attention, sm_scale=H**-0.5, impl=impl,
                                  kv_cache_dtype=values), donate_argnames="kv_cache")
    return f.lower(
        q=S((T, N, H), f32), k=S((T, K, H), f32), v=S((T, K, H), f32),
        kv_cache=S((P, L, 2 * K, H), stored), slot_mapping=S((T,), i32),
        block_tables=S((R, 8), i32), seq_lens=S((R,), i32), query_start_loc=S((R + 1,), i32),
        num_seqs=S((), i32)).compile().as_text()


# An HLO instruction: its result's element type and dims, and its opcode.
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(\w+)\[([\d,]*)\]\S*\s+([\w-]+)\(")


def _whole_cache_rewrites(hlo: str, stored: jnp.dtype) -> list[str]:
    """Instructions that produce the whole cache in another dtype than ``stored`` (a convert
    of it) or copy it: what an in-place write does not have."""
    whole = ("64,16,4,64", "1024,4,64")
    own = {"uint8": "u8", "float8_e4m3fn": "f8e4m3fn"}[jnp.dtype(stored).name]
    found = []
    for line in hlo.splitlines():
        m = INSTRUCTION.match(line)
        if m and m[2] in whole and (m[1] != own or m[3] == "copy"):
            found.append(line.strip())
    return found


@pytest.mark.parametrize("impl", BITS_IMPLS)
def test_a_donated_cache_of_bits_is_written_in_place(impl: str) -> None:
    hlo = _compiled(impl, jnp.uint8, jnp.float8_e4m3fn)
    assert "input_output_alias" in hlo  # the donated cache is the returned one
    assert _whole_cache_rewrites(hlo, jnp.uint8) == []
    # The check sees the rewrite of an fp8 array: XLA on CPU converts it whole to scatter.
    assert _whole_cache_rewrites(_compiled(impl, jnp.float8_e4m3fn, None), jnp.float8_e4m3fn)


def test_the_cpu_path_stores_fp8_as_bits() -> None:
    e4m3, u8 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.uint8)
    assert storage_dtype(e4m3, impl="cpu", platform="cpu") == u8
    assert storage_dtype(jnp.float8_e5m2, impl="reference", platform="cpu") == u8
    assert storage_dtype(e4m3, impl="reference", platform="tpu") == e4m3
    assert storage_dtype(e4m3, impl="tpu", platform="cpu") == e4m3  # interpret mode
    assert storage_dtype(jnp.bfloat16, impl="cpu", platform="cpu") == jnp.bfloat16


@pytest.mark.parametrize(("impl", "stored", "values", "match"), [
    ("cpu", jnp.uint8, None, r"uint8 kv_cache holds fp8 bits and needs kv_cache_dtype naming "
                             r"their format \(float8_e4m3fn, float8_e5m2\), got "
                             r"kv_cache_dtype=None"),
    ("reference", jnp.uint8, jnp.bfloat16, r"needs kv_cache_dtype .* got kv_cache_dtype="
                                           r"bfloat16"),
    ("tpu", jnp.uint8, jnp.float8_e4m3fn, r"impl='tpu' reads a real float8_e4m3fn kv_cache, "
                                          r"not its bits in uint8 \(only reference, cpu do\)"),
    ("gpu", jnp.uint8, jnp.float8_e5m2, r"impl='gpu' reads a real float8_e5m2"),
    ("cpu", jnp.float8_e4m3fn, jnp.float8_e5m2, r"kv_cache_dtype=float8_e5m2 does not match "
                                                r"the float8_e4m3fn kv_cache"),
])
def test_refusals(impl: str, stored: jnp.dtype, values: jnp.dtype | None, match: str) -> None:
    case = scaled_case(batch=[(1, 5)])
    args = case.args("float32")
    kv = jnp.zeros(args[3].shape, stored)
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(*args[:3], kv, *args[4:], sm_scale=0.125, impl=impl,
                               interpret=True, kv_cache_dtype=values)


@pytest.mark.parametrize("impl", BITS_IMPLS)
def test_writes_round_as_ml_dtypes_numpy_cast(impl: str) -> None:
    """The bytes written for new keys and values are numpy's (ml_dtypes') float32 -> e4m3 cast
    (vLLM's "fp8"), round to nearest even: values at and one float32 ulp beside every midpoint
    between two fp8 numbers, where a double rounding (through bfloat16 or float16) would
    differ."""
    dtype = jnp.dtype(jnp.float8_e4m3fn)
    grid = np.unique(np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32))
    grid = grid[np.isfinite(grid)]
    mid = (grid[:-1] + grid[1:]) / 2
    values = np.concatenate([mid, np.nextafter(mid, np.inf), np.nextafter(mid, -np.inf)])
    case = scaled_case(batch=[(64, 64)], garbage=None)
    T, K2, H = case.num_tokens, case.kv_cache.shape[2], case.kv_cache.shape[3]
    new = np.resize(values, (2, *case.k.shape)).astype(np.float32)  # [2, T padded, K, H]
    args = list(case.args(jnp.float32))
    args[1], args[2] = jnp.asarray(new[0]), jnp.asarray(new[1])
    args[3] = jnp.zeros(case.kv_cache.shape, jnp.uint8)
    _, cache = run(impl, args, case, kv_cache_dtype=dtype)
    rows = np.asarray(cache).reshape(-1, K2, H)[np.asarray(case.slot_mapping)[:T]]
    np.testing.assert_array_equal(rows[:, 0::2], new[0, :T].astype(dtype).view(np.uint8))
    np.testing.assert_array_equal(rows[:, 1::2], new[1, :T].astype(dtype).view(np.uint8))
