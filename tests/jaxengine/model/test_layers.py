"""The leaf layer functions against HF's formulas written out in numpy, eagerly and under jit.

The model runs them jitted and a test that builds one layer alone runs them eagerly; XLA may
fuse a jitted multiply-add into one rounding, so chex's variants check both give HF's numbers.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxengine.model.layers import apply_rope, rms_norm, rope_inv_freq, rope_tables


class TestLayers(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_rms_norm_is_hf_llama_rms_norm(self) -> None:
        norm = self.variant(rms_norm, static_argnames=("eps",))
        rng = np.random.default_rng(0)
        # bfloat16 exactly: scaling before the cast instead rounds ~1 in 4 values differently.
        for dtype, rtol in ((np.float32, 1e-6), (ml_dtypes.bfloat16, 0.0)):
            x = (3 * rng.normal(size=(5, 32))).astype(dtype)  # [T, D]
            w = rng.normal(size=32).astype(dtype)  # [D]
            # HF: normalise in float32, cast back, then scale in the activation dtype.
            x64 = x.astype(np.float64)
            normed = (x64 / np.sqrt(np.mean(x64**2, -1, keepdims=True) + 1e-5)).astype(dtype)
            want = (w.astype(np.float64) * normed.astype(np.float64)).astype(dtype)
            got = norm(jnp.asarray(x), jnp.asarray(w), eps=1e-5)
            chex.assert_type(got, dtype)
            chex.assert_trees_all_close(np.asarray(got, np.float32), want.astype(np.float32),
                                        rtol=rtol, atol=0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_rope_is_hf_rotate_half_and_sees_only_relative_positions(self) -> None:
        H = 8
        inv = rope_inv_freq(H, 10_000.0, None)  # f32[H/2]
        rotate = self.variant(lambda x, pos: apply_rope(x, *rope_tables(pos, inv)))
        rng = np.random.default_rng(1)
        q, k = (rng.normal(size=(6, 2, H)).astype(np.float32) for _ in range(2))  # [T, N, H]
        pos = np.asarray([0, 1, 5, 17, 30, 63], np.int32)
        # HF: angles = float32 positions x inv_freq, the two halves repeated (not interleaved);
        # x * cos + rotate_half(x) * sin.
        angles = np.tile(pos[:, None].astype(np.float32) * inv, 2).astype(np.float64)  # [T, H]
        cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
        rotate_half = np.concatenate([-q[..., H // 2:], q[..., : H // 2]], axis=-1)
        chex.assert_shape(rotate(q, pos), q.shape)
        chex.assert_trees_all_close(np.asarray(rotate(q, pos)), q * cos + rotate_half * sin,
                                    rtol=1e-6, atol=1e-6)

        def scores(shift: int) -> np.ndarray:  # f32[N, T, T]
            qr, kr = np.asarray(rotate(q, pos + shift)), np.asarray(rotate(k, pos + shift))
            return np.einsum("tnh,snh->nts", qr, kr)

        # q.k after rotation depends on the distance between positions only.
        chex.assert_trees_all_close(scores(64), scores(0), rtol=0, atol=1e-4)
        assert not np.allclose(scores(0)[:, 0, 1:], np.einsum("nh,snh->ns", q[0], k[1:]))
