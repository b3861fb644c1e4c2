"""The keys' rotation of an fp8 cache (kv_rotation.py): orthonormal for every head size, so
scores are unchanged, and it lowers the scores' fp8 error where a few channels carry them."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.model.kv_rotation import kv_rotation, rotate


@pytest.mark.parametrize("head_dim", [1, 8, 64, 80, 96, 112, 128, 256])
def test_the_rotation_is_orthonormal_with_hadamard_blocks(head_dim: int) -> None:
    r = kv_rotation(head_dim)
    np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=1e-6)
    # The largest power of two leads: its block is dense with entries ±1/sqrt(size).
    size = 1 << (head_dim.bit_length() - 1)
    np.testing.assert_allclose(np.abs(r[:size, :size]), size**-0.5, rtol=1e-6)
    assert not r[:size, size:].any() and not r[size:, :size].any()


def test_rotating_q_and_k_keeps_the_scores() -> None:
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((5, 3, 80)).astype(np.float32) for _ in range(2))
    scores = np.einsum("tnh,snh->nts", q, k)
    rotated = np.einsum("tnh,snh->nts", np.asarray(rotate(jnp.asarray(q))),
                        np.asarray(rotate(jnp.asarray(k))))
    np.testing.assert_allclose(rotated, scores, rtol=1e-5, atol=1e-4)


def test_rotated_keys_lose_less_of_the_scores_to_fp8() -> None:
    # Keys and queries whose products sit in four channels of 64 (as RoPE'd keys' do).
    rng = np.random.default_rng(1)
    scale = np.ones(64, np.float32)
    scale[[3, 17, 40, 41]] = 12.0
    q = (rng.standard_normal((32, 1, 64)) * scale).astype(np.float32)
    k = (rng.standard_normal((256, 1, 64)) * scale).astype(np.float32)

    def fp8(x: np.ndarray) -> np.ndarray:
        return np.asarray(jnp.asarray(x).astype(jnp.float8_e4m3fn).astype(jnp.float32))

    exact = np.einsum("tnh,snh->nts", q, k)
    plain = np.einsum("tnh,snh->nts", q, fp8(k))
    qr, kr = np.asarray(rotate(jnp.asarray(q))), np.asarray(rotate(jnp.asarray(k)))
    rotated = np.einsum("tnh,snh->nts", qr, fp8(kr))
    plain_err, rotated_err = np.abs(plain - exact).mean(), np.abs(rotated - exact).mean()
    assert rotated_err < 0.5 * plain_err, (rotated_err, plain_err)
