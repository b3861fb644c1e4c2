"""The grouped matmul against a numpy reference: every implementation in float32 and (but the
native kernel) bfloat16, group sizes with empty groups, all rows in one group, and rows left in
no group."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine_kernels import cpu, default_grouped_impl, grouped_matmul
from jaxengine_kernels.cpu import native
from jaxengine_kernels.grouped_matmul import tile_rows

IMPLS = ("xla", "native", "tiles")
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def reference(x: np.ndarray, w: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """out[r] = x[r] @ w[group of r] in float64; rows past sum(sizes) zero."""
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for e, size in enumerate(sizes):
        out[start:start + size] = x[start:start + size].astype(np.float64) @ w[e]
        start += size
    return out


def case(rows: int, sizes: list[int], *, D: int = 27, F: int = 88, seed: int = 0
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, D)).astype(np.float32)
    w = rng.standard_normal((len(sizes), D, F)).astype(np.float32)
    return x, w, np.asarray(sizes, np.int32)


def random_sizes(rows: int, groups: int, seed: int) -> list[int]:
    """Sizes summing to `rows` with some groups empty (a third of them, at least one)."""
    rng = np.random.default_rng(seed)
    used = rng.permutation(groups)[: max(1, groups - max(1, groups // 3))]
    return np.bincount(rng.choice(used, rows), minlength=groups).tolist()


SIZES = {
    "random_with_empty": (100, random_sizes(100, 8, seed=1)),
    "all_in_one": (70, [0, 0, 70, 0, 0]),
    "all_in_last": (33, [0, 0, 0, 33]),
    "one_row_each": (6, [1, 1, 1, 1, 1, 1]),
    "rows_in_no_group": (50, [3, 0, 17, 9]),  # the last 21 rows come out zero
    "no_rows_in_any": (12, [0, 0, 0]),
    "tile_multiples": (192, [64, 0, 128]),
}


@pytest.mark.parametrize(("impl", "dtype"), [
    ("xla", jnp.float32), ("xla", jnp.bfloat16), ("native", jnp.float32),
    ("tiles", jnp.float32), ("tiles", jnp.bfloat16)], ids=lambda v: getattr(v, "__name__", v))
@pytest.mark.parametrize("name", list(SIZES))
def test_matches_the_reference(impl: str, dtype: jnp.dtype, name: str) -> None:
    rows, sizes = SIZES[name]
    x, w, sizes = case(rows, sizes)
    xd, wd = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    out = jax.jit(grouped_matmul, static_argnames="impl")(xd, wd, jnp.asarray(sizes), impl=impl)
    assert out.shape == (rows, w.shape[2]) and out.dtype == dtype
    # The reference from the inputs as rounded to dtype: only the result's rounding differs.
    want = reference(np.asarray(xd, np.float32), np.asarray(wd, np.float32), sizes)
    scale = np.abs(want).max() + 1
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=TOL[dtype] * scale,
                               rtol=TOL[dtype])
    np.testing.assert_array_equal(np.asarray(out, np.float32)[sizes.sum():], 0.0)


FIXED = case(64, [0] * 5, seed=9)[:2]  # x [64, 27], w [5, 27, 88]: one compilation per impl
FIXED_CALLS = {impl: jax.jit(functools.partial(grouped_matmul, impl=impl)) for impl in IMPLS}


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 30), min_size=5, max_size=5).filter(lambda s: sum(s) <= 64),
       impl=st.sampled_from(IMPLS))
def test_any_group_sizes_match_the_reference(sizes: list[int], impl: str) -> None:
    x, w = FIXED
    out = FIXED_CALLS[impl](x, w, jnp.asarray(sizes, jnp.int32))
    np.testing.assert_allclose(np.asarray(out), reference(x, w, np.asarray(sizes)), atol=1e-4,
                               rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_preferred_element_type_sets_the_result_dtype(impl: str) -> None:
    x, w, sizes = case(20, [5, 15])
    out = grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), impl=impl,
                         preferred_element_type=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16


def test_a_narrow_strip_of_columns_matches_the_reference() -> None:
    """The native kernel's columns past the last full strip (N = 40: no full strip)."""
    x, w, sizes = case(30, [7, 0, 23], F=40)
    out = grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), impl="native")
    np.testing.assert_allclose(np.asarray(out), reference(x, w, sizes), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_compiles_once_for_every_routing(impl: str) -> None:
    """Group sizes are traced: new sizes of the same shapes reuse the compilation."""
    chex.clear_trace_counter()  # the other impl's run traced a function of this name

    @jax.jit
    @chex.assert_max_traces(n=1)  # a retrace raises inside the call
    def f(x, w, sizes):
        return grouped_matmul(x, w, sizes, impl=impl)

    for sizes in ([40, 0, 0, 0], [10, 10, 10, 10], [0, 1, 0, 30], [0, 0, 0, 0]):
        x, w, sizes = case(40, sizes, seed=sum(sizes))
        np.testing.assert_allclose(np.asarray(f(x, w, jnp.asarray(sizes))),
                                   reference(x, w, sizes), atol=1e-4, rtol=1e-5)


def test_tiles_grow_with_the_mean_group_size() -> None:
    assert tile_rows(16, 8) == 8  # decode: one small tile per expert
    assert tile_rows(96, 8) == 16
    assert tile_rows(4096, 8) == 64


def test_default_impl_per_platform() -> None:
    assert cpu.available() is None  # the native library builds here
    assert default_grouped_impl("cpu") == "native"
    assert default_grouped_impl("cpu", jnp.bfloat16) == "tiles"  # native is float32 only
    assert default_grouped_impl("tpu") == "xla"
    assert default_grouped_impl("gpu") == "xla"


def test_bad_arguments_are_named() -> None:
    x, w, sizes = case(8, [4, 4])
    with pytest.raises(ValueError, match="impl='dense' is unknown"):
        grouped_matmul(x, w, jnp.asarray(sizes), impl="dense")
    with pytest.raises(ValueError, match=r"group_sizes has shape \(3,\); w has 2 groups"):
        grouped_matmul(x, w, jnp.asarray([4, 4, 0]), impl="tiles")
    with pytest.raises(ValueError, match=r"impl='native' takes float32, got x bfloat16"):
        grouped_matmul(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16),
                       jnp.asarray(sizes), impl="native")
    with pytest.raises(ValueError, match=r"x \[M, D\] and w \[E, D, F\]"):
        grouped_matmul(x[:, :5], w, jnp.asarray(sizes), impl="tiles")



@pytest.mark.parametrize("isa", native.X86_ISAS)
def test_every_isa_build_of_the_native_kernel_matches_the_reference(isa, isa_library):
    """Built for AVX-512 (strips of 64 columns, 6-row blocks), AVX2 (32, 2-row blocks) and
    baseline SSE2 (16, 2-row blocks): the blocking changes with the ISA, the products must not.
    Each runs where the CPU can execute it; the others are skipped, naming the missing CPU
    flags."""
    target = f"jaxengine_test_grouped_matmul_f32_{isa}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(isa_library(isa).GroupedMatmulF32),
                                platform="cpu")
    for name in ("random_with_empty", "rows_in_no_group", "tile_multiples"):
        rows, sizes = SIZES[name]
        x, w, sizes = case(rows, sizes, F=100)
        out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows, 100), jnp.float32))(
            jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes))
        np.testing.assert_allclose(np.asarray(out), reference(x, w, sizes), atol=1e-4,
                                   rtol=1e-5)
