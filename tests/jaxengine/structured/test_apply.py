"""apply_token_bitmask (jnp) against llguidance's numpy reference and by hand."""

import jax
import jax.numpy as jnp
import llguidance.numpy as llg_np
import numpy as np
import pytest

from jaxengine.structured import apply_token_bitmask, bitmask_width


@pytest.mark.parametrize("rows, vocab", [(1, 32), (3, 100), (4, 49152), (2, 49155)])
def test_matches_llguidance_reference(rows, vocab) -> None:
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    mask = rng.integers(-(2**31), 2**31, (rows, bitmask_width(vocab)), dtype=np.int64)
    mask = mask.astype(np.int32)
    mask[0] = -1  # a row without a grammar
    expected = logits.copy()
    llg_np.apply_token_bitmask_inplace(expected, mask)
    got = np.asarray(jax.jit(apply_token_bitmask)(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got[0], logits[0])


def test_by_hand_and_narrow_masks() -> None:
    logits = jnp.arange(70, dtype=jnp.float32)[None]  # V = 70
    mask = jnp.array([[0b101, -(1 << 31)]], dtype=jnp.int32)  # W = 2 < ceil(70 / 32); bit 31
    out = np.asarray(apply_token_bitmask(logits, mask))
    assert np.flatnonzero(np.isfinite(out)).tolist() == [0, 2, 63]  # bits 0, 2 and 32 + 31
    assert out[0, 2] == 2.0 and np.isneginf(out[0, 64:]).all()  # past 32 * W: disallowed


def test_keeps_the_dtype() -> None:
    logits = jnp.ones((2, 40), jnp.bfloat16)
    mask = jnp.full((2, 2), -1, jnp.int32).at[1, 0].set(0)
    out = apply_token_bitmask(logits, mask)
    assert out.dtype == jnp.bfloat16
    assert bool(jnp.isneginf(out[1, :32]).all()) and bool((out[1, 32:] == 1).all())
