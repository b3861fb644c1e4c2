"""`argmax` (two plain reductions) against `jnp.argmax` on what logits hold: ties, infinities,
NaNs, bool masks and bfloat16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine.sampling.argmax import argmax

jitted = jax.jit(argmax)
VALUES = [0.0, 1.0, -1.0, 2.5, np.inf, -np.inf, np.nan]


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), cols=st.integers(1, 40), data=st.data())
def test_matches_jnp_argmax_with_ties_infinities_and_nans(rows: int, cols: int,
                                                          data: st.DataObject) -> None:
    # Drawn from a few values, so rows repeat their maximum, hold +-inf and sometimes NaN.
    flat = data.draw(st.lists(st.sampled_from(VALUES), min_size=rows * cols,
                              max_size=rows * cols))
    x = jnp.asarray(np.array(flat, np.float32).reshape(rows, cols))
    got = jitted(x)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, jnp.argmax(x, axis=-1))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_vocabulary_wide_batch(dtype: jnp.dtype) -> None:
    x = jax.random.normal(jax.random.key(0), (3, 5, 49152)).astype(dtype)  # [..., V]
    x = x.at[1, 2, 7].set(100.0).at[1, 2, 9].set(100.0)  # a tie: the first index wins
    got = jitted(x)
    np.testing.assert_array_equal(got, jnp.argmax(x, axis=-1))
    assert int(got[1, 2]) == 7


def test_bool_masks_give_the_first_true_or_zero() -> None:
    mask = jnp.array([[False, True, True], [False, False, False], [True, False, True]])
    np.testing.assert_array_equal(jitted(mask), [1, 0, 0])
