"""Batch invariance of the native CPU kernels: a row's bits do not depend on what is beside it.

The packed matmul sums each output's K products in K's order whatever the row count or the
row's place among the row blocks, chunked units and runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cpu.matmul import pack, pack_swiglu, packed_matmul, packed_swiglu

# Around the kernel's row blocks (6), chunked units (7-64 rows) and runs (96).
ROW_COUNTS = [1, 2, 5, 6, 7, 49, 64, 65, 96, 97, 2048]


@pytest.mark.parametrize("glu", [False, True])
def test_a_packed_matmul_row_does_not_depend_on_the_row_count(glu: bool) -> None:
    K, N = 576, 192
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2048 + 5, K), np.float32))
    if glu:
        panels = pack_swiglu(*rng.standard_normal((2, K, N), np.float32))
        product = jax.jit(lambda x, live: packed_swiglu(x, panels, N, live))
    else:
        panels = pack(rng.standard_normal((K, N), np.float32))
        product = jax.jit(lambda x, live: packed_matmul(x, panels, N, live))
    # vmap runs the kernel once per row: every row computed alone.
    alone = np.asarray(jax.vmap(lambda row: product(row[None], 1)[0])(x))
    for m in ROW_COUNTS:
        for first in (0, 1, 5):  # the same rows at other places in the blocks
            got = np.asarray(product(x[first:first + m], m))
            np.testing.assert_array_equal(got, alone[first:first + m], err_msg=f"{m} rows")
    got = np.asarray(product(x[:64], 49))  # an engine step's padding rows are not computed
    np.testing.assert_array_equal(got[:49], alone[:49])
