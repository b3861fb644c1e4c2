"""The grouped matmul against a numpy reference: both implementations, float32 and bfloat16,
group sizes with empty groups, all rows in one group, and rows left in no group."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine_kernels import default_grouped_impl, grouped_matmul
from jaxengine_kernels.grouped_matmul import tile_rows

IMPLS = ("xla", "tiles")
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def reference(x: np.ndarray, w: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """out[r] = x[r] @ w[group of r] in float64; rows past sum(sizes) zero."""
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for e, size in enumerate(sizes):
        out[start:start + size] = x[start:start + size].astype(np.float64) @ w[e]
        start += size
    return out


def case(rows: int, sizes: list[int], *, D: int = 24, F: int = 40, seed: int = 0
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


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
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


@pytest.mark.parametrize("impl", IMPLS)
def test_preferred_element_type_sets_the_result_dtype(impl: str) -> None:
    x, w, sizes = case(20, [5, 15])
    out = grouped_matmul(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16),
                         jnp.asarray(sizes), impl=impl, preferred_element_type=jnp.float32)
    assert out.dtype == jnp.float32


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
    assert default_grouped_impl("cpu") == "tiles"
    assert default_grouped_impl("tpu") == "xla"
    assert default_grouped_impl("gpu") == "xla"


def test_bad_arguments_are_named() -> None:
    x, w, sizes = case(8, [4, 4])
    with pytest.raises(ValueError, match="impl='dense' is unknown"):
        grouped_matmul(x, w, jnp.asarray(sizes), impl="dense")
    with pytest.raises(ValueError, match=r"group_sizes has shape \(3,\); w has 2 groups"):
        grouped_matmul(x, w, jnp.asarray([4, 4, 0]), impl="tiles")
    with pytest.raises(ValueError, match=r"x \[M, D\] and w \[E, D, F\]"):
        grouped_matmul(x[:, :5], w, jnp.asarray(sizes), impl="tiles")

