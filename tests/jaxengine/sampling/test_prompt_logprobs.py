"""Prompt logprobs on the device against numpy: each position's target logprob, its rank and
the top k, over more positions than one block (the last block padded), zeros where no target,
and all zeros (the skipped branch) when no position has one."""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxengine.sampling.prompt_logprobs import ROWS_PER_BLOCK, prompt_logprobs

T, D, V, K = ROWS_PER_BLOCK + 44, 8, 50, 4


def _logits_fn(w: jax.Array, hidden: jax.Array) -> jax.Array:
    return hidden @ w


_jitted = jax.jit(functools.partial(prompt_logprobs, _logits_fn, num_top=K))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_every_position_with_a_target_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(D, V)).astype(np.float32)
    hidden = rng.normal(size=(T, D)).astype(np.float32)
    targets = rng.integers(0, V, T).astype(np.int32)
    targets[rng.random(T) < 0.3] = -1
    out = jax.device_get(_jitted(w, hidden, targets))
    ref = _log_softmax(hidden.astype(np.float64) @ w)
    has = targets >= 0
    lp = ref[np.arange(T), np.maximum(targets, 0)]
    np.testing.assert_allclose(out.logprobs[has], lp[has], atol=1e-4)
    rank = 1 + (ref > lp[:, None]).sum(-1)
    np.testing.assert_array_equal(out.ranks[has], rank[has])
    order = np.argsort(-ref, axis=-1)[:, :K]
    np.testing.assert_array_equal(out.top_token_ids[has], order[has])
    np.testing.assert_allclose(out.top_logprobs[has],
                               np.take_along_axis(ref, order, -1)[has], atol=1e-4)
    for a in (out.logprobs, out.ranks, out.top_token_ids, out.top_logprobs):
        assert not np.any(a[~has])  # no target: zeros
    assert out.top_token_ids.shape == (T, K) and out.logprobs.dtype == np.float32


def test_no_target_anywhere_is_all_zeros() -> None:
    rng = np.random.default_rng(1)
    w = rng.normal(size=(D, V)).astype(np.float32)
    out = jax.device_get(_jitted(w, rng.normal(size=(T, D)).astype(np.float32),
                                 np.full(T, -1, np.int32)))
    assert all(not np.any(a) for a in (out.logprobs, out.ranks, out.top_token_ids,
                                        out.top_logprobs))
