"""Reverse mode through the kernels: every attention implementation's gradients w.r.t. q, k, v
and the cache against a dense jnp attention written plainly here (gather each request's
context, mask, softmax) and against central finite differences of the implementation's own
forward; the packed and grouped matmuls' gradients against the dense ``x @ w``.

The batches are ``cases.make_case``'s: shuffled block tables, NaN in every slot without
context, padding tokens and padding requests, so a NaN that leaked into a gradient would fail.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine_kernels import ragged_paged_attention
from tests.jaxengine_kernels.cases import Case, make_case

# Tiny shapes the Pallas kernels run in interpret mode (tests/jaxengine_kernels/test_kernels.py).
BLOCKS = {
    "reference": {"block_q": 8, "pages_per_chunk": 2},
    "cpu": {"block_q": 4, "pages_per_split": 2},
    "tpu": {"block_q": 8, "pages_per_block": 2},
    "gpu": {"num_splits": 3},
}
# (q_len, context_len) per request: a decode, a whole prefill, a chunk over a cached prefix.
BATCH = [(1, 21), (12, 12), (5, 37)]
HEADS, KV_HEADS, HEAD_DIM, PAGE = 4, 2, 64, 16  # GQA: 2 query heads per kv head
WINDOW, CAP = 7, 0.7  # the window cuts every request's context


def dense_attention(q, k, v, kv_cache, case: Case, *, window: int = 0,
                    soft_cap: float | None = None):
    """The textbook formula over the written cache: ``(out [T_live, N, H], cache)``."""
    P, L, K2, H = kv_cache.shape
    K, N = K2 // 2, q.shape[1]
    new = jnp.stack([k, v], axis=2).reshape(-1, K2, H)
    flat = kv_cache.reshape(P * L, K2, H).at[case.slot_mapping].set(new)
    outs = []
    qsl, bt = case.query_start_loc, case.block_tables
    for r in range(int(case.num_seqs)):
        s, t0, t1 = int(case.seq_lens[r]), int(qsl[r]), int(qsl[r + 1])
        pos = np.arange(s)
        q_pos = s - (t1 - np.arange(t0, t1))
        visible = pos[None, :] <= q_pos[:, None]  # [t, S]
        if window:
            visible &= pos[None, :] > q_pos[:, None] - window
        # Keys no query sees (slid out of every window) may be NaN: zeroed, not multiplied.
        ctx = flat[bt[r, pos // L] * L + pos % L]  # [S, 2K, H]
        ctx = jnp.where(visible.any(axis=0)[:, None, None], ctx, 0.0)
        q_r = q[t0:t1].reshape(t1 - t0, K, N // K, H)
        logits = jnp.einsum("tkgh,skh->tkgs", q_r, ctx[:, 0::2]) * case.sm_scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        logits = jnp.where(visible[:, None, None, :], logits, -jnp.inf)
        w = jax.nn.softmax(logits, axis=-1)
        outs.append(jnp.einsum("tkgs,skh->tkgh", w, ctx[:, 1::2]).reshape(t1 - t0, N, H))
    return jnp.concatenate(outs), flat.reshape(P, L, K2, H)


def scalar_loss(out, cache, weights, live_tokens, cache_mask):
    """A random linear function of the live output rows and of the cache's context slots
    (block 0, where padding tokens write in an unspecified order, and NaN slots left out)."""
    w_out, w_cache = weights
    return (jnp.sum(w_out * out[:live_tokens]) +
            jnp.sum(jnp.where(cache_mask, w_cache * cache, 0.0)))


def _case(**kw) -> Case:
    return make_case(BATCH, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                     page_size=PAGE, **kw)


def _weights(case: Case, seed: int):
    rng = np.random.default_rng(seed)
    T, N, H = case.q.shape
    w_out = rng.standard_normal((case.num_tokens, N, H)).astype(np.float32)
    w_cache = rng.standard_normal(case.kv_cache.shape).astype(np.float32)
    return jnp.asarray(w_out), jnp.asarray(w_cache)


def _cache_mask(case: Case) -> np.ndarray:
    """The slots the loss reads: finite after the step's writes, outside block 0."""
    P, L, K2, H = case.kv_cache.shape
    finite = np.isfinite(case.kv_cache).reshape(P * L, K2, H)
    finite[case.slot_mapping] = True
    finite = finite.reshape(P, L, K2, H)
    finite[0] = False
    return finite


def check_gradients(loss, want: tuple, primals: tuple) -> tuple:
    """``loss``'s gradients w.r.t. every primal against ``want`` (<= 1e-4 relative), and its
    directional derivative against central finite differences of ``loss`` itself along a
    random direction that leaves the NaN slots alone. Returns the gradients."""
    # One compilation: the finite differences take the values of the same jitted function.
    value_and_grad = jax.jit(jax.value_and_grad(loss, tuple(range(len(primals)))))
    _, grads = value_and_grad(*primals)
    for i, (g, w) in enumerate(zip(grads, want, strict=True)):
        assert np.all(np.isfinite(g)), f"primal {i}"
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max(),
                                   err_msg=f"primal {i}")
    rng = np.random.default_rng(2)
    direction = [jnp.where(jnp.isfinite(x), rng.standard_normal(x.shape), 0.0).astype(x.dtype)
                 for x in primals]
    eps = 1e-2
    plus, _ = value_and_grad(*(x + eps * d for x, d in zip(primals, direction, strict=True)))
    minus, _ = value_and_grad(*(x - eps * d for x, d in zip(primals, direction, strict=True)))
    analytic = sum(float(jnp.sum(g * d)) for g, d in zip(grads, direction, strict=True))
    np.testing.assert_allclose(analytic, float(plus - minus) / (2 * eps), rtol=2e-3)
    return grads


def attention(impl: str, case: Case, **kw):
    """``ragged_paged_attention`` of ``impl`` over ``case``'s metadata, as f(q, k, v, cache)."""
    def attend(q, k, v, cache):
        return ragged_paged_attention(q, k, v, cache, *case.args(jnp.float32)[4:],
                                      sm_scale=case.sm_scale, impl=impl, interpret=True,
                                      **BLOCKS[impl], **kw)
    return attend


@pytest.fixture(scope="module")
def one_step():
    """A decode, a prefill and a chunk over a cached prefix (GQA, a window, a soft cap, NaN in
    every slot without context, padding tokens and requests): ``(case, loss of an attention
    function, the dense formula's gradients)``."""
    case = _case(sliding_window=WINDOW, seed=3)
    weights, mask, T_live = _weights(case, 1), _cache_mask(case), case.num_tokens

    def loss_of(attend):
        return lambda *primals: scalar_loss(*attend(*primals), weights, T_live, mask)

    dense = loss_of(lambda *p: dense_attention(*p, case, window=WINDOW, soft_cap=CAP))
    want = jax.jit(jax.grad(dense, (0, 1, 2, 3)))(*case.args(jnp.float32)[:4])
    return case, loss_of, want


@pytest.mark.parametrize("impl", ["reference", "cpu", "tpu", "gpu"])
def test_attention_gradients_match_dense_and_finite_differences(impl, one_step):
    case, loss_of, want = one_step
    loss = loss_of(attention(impl, case, sliding_window=WINDOW, soft_cap=CAP))
    grads = check_gradients(loss, want, case.args(jnp.float32)[:4])
    assert np.abs(grads[1]).max() > 0  # k reaches the loss through the cache
