"""The native packed matmul against numpy's product: every row count around the kernel's
register blocks and runs, column counts off the panel width, leading axes, vmap, the build for
each x86 ISA level the CPU runs, and clear errors for panels that do not fit; kernels packed
side by side or from their transpose as one; the fused SwiGLU product against
silu(x @ gate) * (x @ up); the same over int8 panels with group scales."""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine_kernels.cpu import native
from jaxengine_kernels.cpu.matmul import (
    pack,
    pack_int8,
    pack_swiglu,
    pack_swiglu_int8,
    pack_transposed,
    packed_matmul,
    packed_matmul_int8,
    packed_swiglu,
    packed_swiglu_int8,
    panel_width,
)


def operands(m: int, k: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, k)).astype(np.float32),
            rng.standard_normal((k, n)).astype(np.float32))


def check(y: jax.Array | np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    want = x.astype(np.float64) @ w.astype(np.float64)
    scale = np.sqrt(x.shape[1])  # float32 sums of K products of unit normals
    np.testing.assert_allclose(np.asarray(y), want, atol=1e-5 * scale, rtol=1e-5)


def test_panels_hold_the_columns_in_order_with_zeros_past_n():
    w = np.arange(3 * 70, dtype=np.float32).reshape(3, 70)
    panels = np.asarray(pack(w))
    width = panel_width()
    assert panels.shape == (-(-70 // width), 3, width)
    flat = panels.transpose(1, 0, 2).reshape(3, -1)
    np.testing.assert_array_equal(flat[:, :70], w)
    assert not flat[:, 70:].any()


def test_kernels_side_by_side_and_a_transposed_table_pack_as_one_kernel():
    q, k, v = (np.arange(3 * n, dtype=np.float32).reshape(3, n) + 1000 * i
               for i, n in enumerate((70, 5, 33)))
    both = np.concatenate([q, k, v], axis=1)
    np.testing.assert_array_equal(np.asarray(pack(q, k, v)), np.asarray(pack(both)))
    np.testing.assert_array_equal(np.asarray(pack_transposed(both.T)), np.asarray(pack(both)))


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 200), k=st.integers(1, 80), n=st.integers(1, 200),
       seed=st.integers(0, 2**16))
def test_matches_numpy_for_any_shape(m, k, n, seed):
    x, w = operands(m, k, n, seed)
    check(packed_matmul(jnp.asarray(x), pack(w), n), x, w)


# Row blocks of 6 (4 with AVX2), chunked units of 7-64 rows (5-64), runs of 96.
@pytest.mark.parametrize("m", [1, 4, 5, 6, 7, 13, 48, 49, 64, 65, 95, 96, 97, 2048])
def test_matches_numpy_at_the_model_shapes(m):
    x, w = operands(m, 576, 192, seed=m)
    check(jax.jit(packed_matmul, static_argnums=2)(jnp.asarray(x), pack(w), 192), x, w)


@pytest.mark.parametrize("m,live", [(64, 49), (64, 0), (7, 7), (200, 97), (5, 9)])
def test_live_rows_are_computed_and_the_padding_is_zero(m, live):
    """`live` rows (clamped to x's) as numpy's product, the rows after them zeros, even where
    x's padding holds NaN; traced, so one program serves every count."""
    x, w = operands(m, 64, 100, seed=m + live)
    x[min(live, m):] = np.nan
    y = np.asarray(jax.jit(packed_matmul, static_argnums=2)(jnp.asarray(x), pack(w), 100,
                                                            jnp.int32(live)))
    rows = min(live, m)
    check(y[:rows], x[:rows], w)
    assert not y[rows:].any()


def test_leading_axes_are_rows():
    x, w = operands(12, 16, 40, seed=1)
    y = packed_matmul(jnp.asarray(x).reshape(2, 3, 2, 16), pack(w), 40)
    assert y.shape == (2, 3, 2, 40)
    check(np.asarray(y).reshape(12, 40), x, w)


def test_vmap_runs_the_kernel_per_element():
    x, w = operands(6, 16, 40, seed=2)
    xs = jnp.stack([jnp.asarray(x), 2 * jnp.asarray(x)])
    ys = jax.vmap(lambda a: packed_matmul(a, pack(w), 40))(xs)
    check(ys[0], x, w)
    check(ys[1], 2 * x, w)


def test_panels_that_do_not_fit_are_refused_by_shape():
    x, w = operands(3, 16, 40, seed=3)
    n = 40 + panel_width()  # one panel more than the weights hold
    with pytest.raises(ValueError, match=rf"do not pack a \[16, {n}\] kernel"):
        packed_matmul(jnp.asarray(x), pack(w), n)
    with pytest.raises(ValueError, match=r"do not pack a \[17, 40\] kernel"):
        packed_matmul(jnp.ones((3, 17)), pack(w), 40)
    with pytest.raises(ValueError, match="takes float32 x and float32 panels, got bfloat16"):
        packed_matmul(jnp.asarray(x, jnp.bfloat16), pack(w), 40)


def swiglu(x: np.ndarray, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    g = x.astype(np.float64) @ gate.astype(np.float64)
    sigmoid = np.exp(-np.logaddexp(0, -g))  # without overflow for any g
    return g * sigmoid * (x.astype(np.float64) @ up.astype(np.float64))


# Row blocks, chunked units and runs as above; n off the panel width; gates of both signs and
# past exp's range (|g| ~ 100 must neither overflow nor lose the product).
@pytest.mark.parametrize("m,k,n,live", [(1, 576, 1536, 1), (13, 64, 100, 13), (48, 33, 70, 40),
                                        (97, 64, 130, 97), (200, 16, 64, 150)])
def test_the_swiglu_product_is_silu_of_the_gate_times_up(m, k, n, live):
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, k)).astype(np.float32)
    gate = (rng.standard_normal((k, n)) * np.where(rng.random(n) < 0.1, 30, 1)).astype(np.float32)
    up = rng.standard_normal((k, n)).astype(np.float32)
    x[live:] = np.nan  # padding rows are never read
    y = np.asarray(jax.jit(packed_swiglu, static_argnums=2)(
        jnp.asarray(x), pack_swiglu(gate, up), n, jnp.int32(live)))
    want = swiglu(x[:live], gate, up)
    scale = np.sqrt(k) * np.maximum(1, np.abs(want))
    assert np.all(np.abs(y[:live] - want) <= 2e-5 * scale)
    assert np.abs(want).max() > 100  # the large gates reached the output
    assert not y[live:].any()


def test_swiglu_panels_that_do_not_fit_are_refused():
    x, w = operands(3, 16, 40, seed=3)
    with pytest.raises(ValueError, match=r"do not pack gate and up \[16, 40\] kernels"):
        packed_swiglu(jnp.asarray(x), pack(w), 40)  # one kernel's panels, not two


@pytest.mark.parametrize("isa", native.X86_ISAS)
def test_every_isa_build_matches_numpy(isa, isa_library):
    """Built for AVX-512 (panels of 64 columns, 6-row blocks), AVX2 (24, 4-row blocks) and
    baseline SSE2 (16, 2-row blocks): the blocking changes with the ISA, the products must not.
    Each runs where the CPU can execute it; the others are skipped, naming the missing CPU
    flags."""
    library = isa_library(isa)
    library.PackedMatmulPanel.restype = ctypes.c_int64
    width = int(library.PackedMatmulPanel())
    assert width == {"avx512": 64, "avx2": 24, "sse2": 16}[isa]
    target = f"jaxengine_test_packed_matmul_f32_{isa}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(library.PackedMatmulF32),
                                platform="cpu")
    for m, k, n in [(1, 9, 5), (7, 64, 100), (130, 33, 48)]:
        x, w = operands(m, k, n, seed=m)
        panels = -(-n // width)
        wp = np.pad(w, ((0, 0), (0, panels * width - n))).reshape(k, panels, width)
        y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((m, n), jnp.float32))(
            jnp.asarray(x), jnp.asarray(wp.transpose(1, 0, 2)), jnp.int32(m))
        check(y, x, w)


def int8_operands(m: int, k: int, n: int, seed: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x f32[m, k], values i8[k, n] and scales f32[k/G, n] for the largest G of 32, 16, 11, 3
    and 1 that divides k (groups of several sizes, one group of all k at k = 33)."""
    rng = np.random.default_rng(seed)
    group = next(g for g in (32, 16, 11, 3, 1) if k % g == 0)
    return (rng.standard_normal((m, k)).astype(np.float32),
            rng.integers(-127, 128, (k, n)).astype(np.int8),
            (rng.random((k // group, n)) * 0.1 + 1e-3).astype(np.float32))


def dequantized(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """values i8[k, n] * their group's scale f32[k/G, n], in float64."""
    return values * np.repeat(scale.astype(np.float64), values.shape[0] // scale.shape[0], 0)


def as_computed(x: np.ndarray, w: np.ndarray, *, pairs: bool) -> tuple[np.ndarray, np.ndarray]:
    """(x, w) as the kernel multiplies them: as they are, or with `pairs` (a build whose int8
    matmuls meet x in bfloat16: `native.int8_pairs`) both rounded to bfloat16, w (a scaled
    weight) from its float32 value."""
    if not pairs:
        return x, w
    return (x.astype(jnp.bfloat16).astype(np.float32),
            w.astype(np.float32).astype(jnp.bfloat16).astype(np.float64))


def check_int8(y: jax.Array | np.ndarray, x: np.ndarray, values: np.ndarray,
               scale: np.ndarray, *, pairs: bool) -> None:
    """x @ (values * scale), each as the kernel takes it (`as_computed`), to float32 rounding
    of its K products and of each weight's product with its scale (|x| @ |values * scale|
    bounds both)."""
    x, w = as_computed(x, dequantized(values, scale), pairs=pairs)
    want = x.astype(np.float64) @ w
    bound = np.abs(x).astype(np.float64) @ np.abs(w)
    assert np.all(np.abs(np.asarray(y) - want) <= 1e-6 * bound + 1e-30)


# Row blocks, chunked units and runs as the float matmul's; n and k off the panel width.
@pytest.mark.parametrize("m,k,n,live", [(1, 576, 192, 1), (7, 33, 5, 7), (64, 64, 100, 49),
                                        (100, 1536, 70, 100), (200, 16, 130, 150)])
def test_int8_panels_give_the_scaled_product(m, k, n, live):
    x, values, scale = int8_operands(m, k, n, seed=m + k)
    x[live:] = np.nan  # padding rows are never read
    y = np.asarray(jax.jit(packed_matmul_int8, static_argnums=3)(
        jnp.asarray(x), *pack_int8(values, scale), n, jnp.int32(live)))
    check_int8(y[:live], x[:live], values, scale, pairs=native.int8_pairs())
    assert not y[live:].any()


@pytest.mark.parametrize("m,k,n", [(1, 576, 1536), (13, 64, 100), (97, 48, 70)])
def test_the_int8_swiglu_product_is_silu_of_the_scaled_gate_times_up(m, k, n):
    x, gate, gs = int8_operands(m, k, n, seed=m)
    _, up, us = int8_operands(m, k, n, seed=m + 1)
    y = packed_swiglu_int8(jnp.asarray(x), *pack_swiglu_int8(gate, gs, up, us), n)
    pairs = native.int8_pairs()
    _, w_gate = as_computed(x, dequantized(gate, gs), pairs=pairs)
    x, w_up = as_computed(x, dequantized(up, us), pairs=pairs)
    want = swiglu(x, w_gate, w_up)
    # float32 rounding of each product's K terms (|x| @ |w| bounds it), carried through
    # silu(g) * u (|silu'| <= 1.1), and silu's own few ulp.
    ax = np.abs(x).astype(np.float64)
    u = x.astype(np.float64) @ w_up
    err_g, err_u = 1e-6 * (ax @ np.abs(w_gate)), 1e-6 * (ax @ np.abs(w_up))
    bound = 1.1 * err_g * np.abs(u) + np.abs(want / u) * err_u + 1e-6 * np.abs(want)
    assert np.all(np.abs(np.asarray(y) - want) <= 2 * bound + 1e-30)


def test_int8_panels_hold_the_values_and_bad_operands_are_refused():
    x, values, scale = int8_operands(3, 16, 40, seed=4)
    panels, scale_panels = pack_int8(values, scale)
    assert panels.dtype == jnp.int8 and scale_panels.dtype == jnp.float32
    for packed, want in ((panels, values), (scale_panels, scale)):
        flat = np.asarray(packed).transpose(1, 0, 2).reshape(want.shape[0], -1)
        np.testing.assert_array_equal(flat[:, :40], want)
        assert not flat[:, 40:].any()
    with pytest.raises(ValueError, match="pack_int8 takes int8 values, got float32"):
        pack_int8(values.astype(np.float32), scale)
    with pytest.raises(ValueError, match=r"take float32 scales \[K/G, 40\] for a group size G "
                                         r"dividing 16, got float32\[3, 40\]"):
        pack_int8(values, np.ones((3, 40), np.float32))
    with pytest.raises(ValueError, match=r"scales must be float32\[\d+, K/G, \d+\] for a group "
                                         r"size G dividing K=16, got float32\[40\]"):
        packed_matmul_int8(jnp.asarray(x), panels, jnp.ones(40), 40)
    with pytest.raises(ValueError, match="takes float32 x and int8 panels, got float32 and "
                                         "float32"):
        packed_matmul_int8(jnp.asarray(x), pack(values.astype(np.float32)), scale_panels, 40)


@pytest.mark.parametrize("isa", native.X86_ISAS)
def test_every_isa_build_matches_numpy_on_int8_panels(isa, isa_library):
    """The int8 widening is an instruction per vector with AVX2 and AVX-512 and the compiler's
    own conversion on baseline x86-64: each build against numpy where the CPU runs it."""
    library = isa_library(isa)
    library.PackedMatmulPanel.restype = ctypes.c_int64
    width = int(library.PackedMatmulPanel())
    target = f"jaxengine_test_packed_matmul_int8_{isa}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(library.PackedMatmulInt8),
                                platform="cpu")
    for m, k, n in [(1, 9, 5), (7, 64, 100), (130, 33, 48)]:
        x, values, scale = int8_operands(m, k, n, seed=m)
        panels = -(-n // width)
        vp, sp = (np.pad(a, ((0, 0), (0, panels * width - n))).reshape(len(a), panels, width)
                  for a in (values, scale))
        y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((m, n), jnp.float32))(
            jnp.asarray(x), jnp.asarray(vp.transpose(1, 0, 2)),
            jnp.asarray(sp.transpose(1, 0, 2)), jnp.int32(m))
        check_int8(y, x, values, scale, pairs=bool(library.PackedInt8Pairs()))


@pytest.mark.parametrize("glu", [False, True])
def test_an_int8_row_does_not_depend_on_the_row_count(glu):
    """A few rows widen the int8 panel a chunk at a time, a long run the whole panel: the same
    scaled weights and products in the same order, so the same bits."""
    x, values, scale = int8_operands(200, 96, 130, seed=9)
    if glu:
        panels = pack_swiglu_int8(values, scale, values[:, ::-1], scale[::-1])
        product = jax.jit(lambda x, live: packed_swiglu_int8(x, *panels, 130, live))
    else:
        panels = pack_int8(values, scale)
        product = jax.jit(lambda x, live: packed_matmul_int8(x, *panels, 130, live))
    alone = np.asarray(jax.vmap(lambda row: product(row[None], 1)[0])(jnp.asarray(x)))
    for m in (1, 6, 7, 64, 65, 97, 200):
        np.testing.assert_array_equal(np.asarray(product(jnp.asarray(x), m))[:m], alone[:m])
