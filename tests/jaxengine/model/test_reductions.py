"""Sums in an order fixed by the summed axis: a row's bits alone and among any number of rows
(XLA's own sums changed order with the row count), and the values of numpy's sums."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.model.layers import rms_norm
from jaxengine.model.reductions import fixed_order_sum, log_softmax, softmax


@pytest.mark.parametrize("width", [1, 8, 64, 97, 576, 1536, 49152])
def test_a_row_sums_to_the_same_bits_among_any_number_of_rows(width: int) -> None:
    rng = np.random.default_rng(width)
    x = jnp.asarray(rng.standard_normal((130, width), np.float32))
    total = jax.jit(fixed_order_sum)
    alone = np.asarray(jax.vmap(lambda row: total(row[None])[0])(x))
    for rows in (2, 7, 8, 9, 64, 65, 130):
        np.testing.assert_array_equal(np.asarray(total(x[:rows])), alone[:rows])
    want = np.asarray(x, np.float64).sum(-1)
    np.testing.assert_allclose(alone, want, atol=1e-6 * np.sqrt(width), rtol=1e-6)


def test_leading_axes_are_rows() -> None:
    x = np.random.default_rng(0).standard_normal((3, 4, 50)).astype(np.float32)
    np.testing.assert_array_equal(fixed_order_sum(jnp.asarray(x)),
                                  fixed_order_sum(jnp.asarray(x.reshape(12, 50))).reshape(3, 4))


def test_softmaxes_match_jax_nn() -> None:
    x = np.random.default_rng(1).normal(scale=5.0, size=(6, 1000)).astype(np.float32)
    x[0, :500] = -np.inf  # masked tokens, as the sampler's filters leave them
    np.testing.assert_allclose(softmax(x), jax.nn.softmax(x, axis=-1), rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(log_softmax(x[1:]), jax.nn.log_softmax(x[1:], axis=-1),
                               rtol=1e-5, atol=1e-5)
    assert not np.asarray(softmax(x))[0, :500].any()


def test_rms_norm_rows_do_not_depend_on_the_row_count() -> None:
    # SmolLM2's width, where XLA's mean rounded rows differently from 8 rows on.
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((64, 576), np.float32))
    norm = jax.jit(lambda x: rms_norm(x, jnp.ones(576), 1e-5))
    alone = np.asarray(jax.vmap(lambda row: norm(row[None])[0])(x))
    for rows in (1, 4, 8, 9, 64):
        np.testing.assert_array_equal(np.asarray(norm(x[:rows])), alone[:rows])
