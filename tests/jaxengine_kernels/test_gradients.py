"""Reverse mode through the kernels: every attention implementation's gradients w.r.t. q, k, v
and the cache against a dense jnp attention written plainly here (gather each request's
context, mask, softmax) and against central finite differences of the implementation's own
forward; the packed, GGUF-block and grouped matmuls' gradients against the dense ``x @ w``.

The batches are ``cases.make_case``'s: shuffled block tables, NaN in every slot without
context, padding tokens and padding requests, so a NaN that leaked into a gradient would fail.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from jaxengine_kernels import grouped_matmul, ragged_paged_attention
from jaxengine_kernels.cpu.block_matmul import block_matmul, block_swiglu
from jaxengine_kernels.cpu.matmul import (
    pack,
    pack_int8,
    pack_swiglu,
    pack_swiglu_int8,
    packed_matmul,
    packed_matmul_int8,
    packed_swiglu,
    packed_swiglu_int8,
)
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
                    soft_cap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0):
    """The textbook formula over the written cache: ``(out [T_live, N, H], cache)``. The cache
    holds ``k / k_scale`` and ``v / v_scale`` in its dtype."""
    P, L, K2, H = kv_cache.shape
    K, N = K2 // 2, q.shape[1]
    new = jnp.stack([k / k_scale, v / v_scale], axis=2).reshape(-1, K2, H)
    flat = kv_cache.reshape(P * L, K2, H).at[case.slot_mapping].set(new.astype(kv_cache.dtype))
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
        ctx = flat[bt[r, pos // L] * L + pos % L].astype(jnp.float32)  # [S, 2K, H]
        ctx = jnp.where(visible.any(axis=0)[:, None, None], ctx, 0.0)
        q_r = q[t0:t1].reshape(t1 - t0, K, N // K, H)
        logits = jnp.einsum("tkgh,skh->tkgs", q_r, ctx[:, 0::2] * k_scale) * case.sm_scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        logits = jnp.where(visible[:, None, None, :], logits, -jnp.inf)
        w = jax.nn.softmax(logits, axis=-1)
        outs.append(jnp.einsum("tkgs,skh->tkgh", w, ctx[:, 1::2] * v_scale).reshape(
            t1 - t0, N, H))
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


def test_attention_gradients_through_a_bfloat16_cache():
    """A quantized cache with scales, straight through its rounding: dq to 1e-4 of the dense
    formula's; dk, dv and the cache's cotangent, which pass through bfloat16 values, to its
    rounding. (Finite differences do not apply: a rounding's derivative is 0 almost
    everywhere.)"""
    case = _case(seed=4)
    q, k, v, cache = case.args(jnp.float32)[:4]
    cache = cache.astype(jnp.bfloat16)
    weights, mask, T_live = _weights(case, 1), _cache_mask(case), case.num_tokens
    scales = {"k_scale": 0.5, "v_scale": 2.0}

    def loss_of(attend):
        return lambda *primals: scalar_loss(*attend(*primals), weights, T_live, mask)

    got = jax.jit(jax.grad(loss_of(attention("cpu", case, **scales)), (0, 1, 2, 3)))(
        q, k, v, cache)
    dense = loss_of(lambda *p: dense_attention(*p, case, **scales))
    want = jax.jit(jax.grad(dense, (0, 1, 2, 3)))(q, k, v, cache)
    assert got[3].dtype == jnp.bfloat16
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        tol = 1e-4 if i == 0 else 1e-2
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * np.abs(w).max(),
                                   err_msg=f"primal {i}")


def test_gradient_flows_from_a_later_step_through_the_cache():
    """Step 1 prefills request 0 (12 tokens), step 2 decodes its 13th and runs a chunk of
    another request; the loss reads step 2's output alone, which depends on step 1's k and v
    only through the cache. (The backward is one formulation for every impl; the native
    kernel's forward compiles fastest.)"""
    step2 = make_case([(1, 13), (5, 37)], num_heads=HEADS, num_kv_heads=KV_HEADS,
                      head_dim=HEAD_DIM, page_size=PAGE, seed=5)
    R, pos = step2.block_tables.shape[0], np.arange(12)
    rng = np.random.default_rng(6)
    step1 = dataclasses.replace(
        step2, slot_mapping=(step2.block_tables[0, pos // PAGE] * PAGE + pos % PAGE),
        seq_lens=np.full(R, 12, np.int32), num_seqs=np.array(1, np.int32),
        query_start_loc=np.array([0] + [12] * R, np.int32),
        **{name: rng.standard_normal((12, n, HEAD_DIM)).astype(np.float32)
           for name, n in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))})
    weights = jnp.asarray(rng.standard_normal((step2.num_tokens, HEADS, HEAD_DIM)), jnp.float32)

    def loss_of(attend1, attend2):
        def loss(k1, v1, q2, k2, v2, cache):
            _, cache = attend1(jnp.asarray(step1.q), k1, v1, cache)
            out2, _ = attend2(q2, k2, v2, cache)
            return jnp.sum(weights * out2[: step2.num_tokens])
        return loss

    primals = (*step1.args(jnp.float32)[1:3], *step2.args(jnp.float32)[:4])
    dense = loss_of(*(functools.partial(dense_attention, case=c) for c in (step1, step2)))
    want = jax.jit(jax.grad(dense, tuple(range(6))))(*primals)
    grads = check_gradients(loss_of(attention("cpu", step1), attention("cpu", step2)), want,
                            primals)
    assert np.abs(grads[0]).max() > 0 and np.abs(grads[1]).max() > 0


def test_no_gradient_through_a_cache_of_fp8_bits():
    case = _case()
    q, k, v, cache, *meta = case.args(jnp.float32)
    bits = jnp.zeros(cache.shape, jnp.uint8)

    def loss(q):
        out, _ = ragged_paged_attention(q, k, v, bits, *meta, sm_scale=case.sm_scale,
                                        kv_cache_dtype=jnp.float8_e4m3fn)
        return out.sum()

    with pytest.raises(ValueError, match="uint8 kv_cache of fp8 bits.*float8_e4m3fn"):
        jax.grad(loss)(q)


def assert_close(got, want) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


M, K_IN, N_OUT, LIVE = 6, 64, 40, 5  # 40 columns: padding in every panel width's last panel
GROUP = 16  # int8 inputs per scale


def _dense_rows(y: jax.Array) -> jax.Array:
    """The rows past LIVE zero, as the kernels' ``live`` makes them."""
    return jnp.where(jnp.arange(M)[:, None] < LIVE, y, 0.0)


@pytest.mark.parametrize("swiglu", [False, True])
def test_packed_matmul_gradients_match_the_dense_product(swiglu):
    """dx and d(panels) = the panel layout of dw (zeros in the padding columns)."""
    rng = np.random.default_rng(7)
    x, c = (jnp.asarray(rng.standard_normal((M, n)), jnp.float32) for n in (K_IN, N_OUT))
    gate, up = (jnp.asarray(rng.standard_normal((K_IN, N_OUT)), jnp.float32) for _ in "gu")

    def loss(x, panels):
        op = packed_swiglu if swiglu else packed_matmul
        return jnp.sum(c * op(x, panels, N_OUT, LIVE))

    def dense(x, gate, up):
        y = jax.nn.silu(x @ gate) * (x @ up) if swiglu else x @ gate
        return jnp.sum(c * _dense_rows(y))

    panels = pack_swiglu(gate, up) if swiglu else pack(gate)
    dx, d_panels = jax.grad(loss, (0, 1))(x, panels)
    want_x, d_gate, d_up = jax.grad(dense, (0, 1, 2))(x, gate, up)
    assert_close(dx, want_x)
    assert_close(d_panels, pack_swiglu(d_gate, d_up) if swiglu else pack(d_gate))
    # Second order (a Hessian-vector product in x, reverse over reverse).
    hvp = jax.grad(lambda x: jnp.vdot(jax.grad(loss)(x, panels), c[:, :1] * x))(x)
    want = jax.grad(lambda x: jnp.vdot(jax.grad(dense)(x, gate, up), c[:, :1] * x))(x)
    assert_close(hvp, want)


@pytest.mark.parametrize("swiglu", [False, True])
def test_int8_matmul_gradients_reach_x_and_the_scales(swiglu):
    rng = np.random.default_rng(8)
    x, c = (jnp.asarray(rng.standard_normal((M, n)), jnp.float32) for n in (K_IN, N_OUT))
    gate, up = (jnp.asarray(rng.integers(-127, 128, (K_IN, N_OUT)), jnp.int8) for _ in "gu")
    gs, us = (jnp.asarray(rng.uniform(0.01, 0.02, (K_IN // GROUP, N_OUT)), jnp.float32)
              for _ in "gu")
    panels, scale = pack_swiglu_int8(gate, gs, up, us) if swiglu else pack_int8(gate, gs)

    def loss(x, scale, panels=panels):
        op = packed_swiglu_int8 if swiglu else packed_matmul_int8
        return jnp.sum(c * op(x, panels, scale, N_OUT, LIVE))

    def dense(x, gs, us):
        g = x @ (gate.reshape(-1, GROUP, N_OUT) * gs[:, None]).reshape(K_IN, N_OUT)
        u = x @ (up.reshape(-1, GROUP, N_OUT) * us[:, None]).reshape(K_IN, N_OUT)
        return jnp.sum(c * _dense_rows(jax.nn.silu(g) * u if swiglu else g))

    dx, d_scale = jax.grad(loss, (0, 1))(x, scale)
    want_dx, *want_scales = jax.grad(dense, (0, 1, 2))(x, gs, us)
    assert_close(dx, want_dx)
    # The scales' cotangent in their panels' layout, gate's and up's interleaved as packed.
    want = pack_swiglu_int8(gate, want_scales[0], up, want_scales[1])[1] if swiglu else \
        pack_int8(gate, want_scales[0])[1]
    assert_close(d_scale, want)
    # The integer values get none.
    assert jax.grad(loss, 2, allow_int=True)(x, scale, panels).dtype == jax.dtypes.float0


@pytest.mark.parametrize(("quant_type", "swiglu"), [("Q4_1", False), ("Q8_0", False),
                                                    ("Q4_1", True)])
def test_block_matmul_gradient_in_x_matches_the_dense_product(quant_type, swiglu):
    rng = np.random.default_rng(9)
    x, c = (jnp.asarray(rng.standard_normal((M, n)), jnp.float32) for n in (K_IN, N_OUT))
    kind = GGMLQuantizationType[quant_type]
    blocks = [quants.quantize(rng.standard_normal((N_OUT, K_IN)).astype(np.float32), kind)
              for _ in "gu"]
    gate, up = (jnp.asarray(quants.dequantize(b, kind)) for b in blocks)

    def loss(x):
        if swiglu:
            return jnp.sum(c * block_swiglu(x, *blocks, quant_type, LIVE))
        return jnp.sum(c * block_matmul(x, blocks[0], quant_type, LIVE))

    def dense(x):
        y = jax.nn.silu(x @ gate.T) * (x @ up.T) if swiglu else x @ gate.T
        return jnp.sum(c * _dense_rows(y))

    assert_close(jax.grad(loss)(x), jax.grad(dense)(x))


@pytest.mark.parametrize("impl", ["native", "tiles", "xla"])
def test_grouped_matmul_gradients_match_the_dense_product(impl):
    """Rows of 3 groups (one empty) and 2 rows past them: dx and dw."""
    rng = np.random.default_rng(10)
    sizes = jnp.asarray([3, 0, 4], jnp.int32)
    group = np.array([0, 0, 0, 2, 2, 2, 2, 0, 0])  # the last two rows belong to no group
    x, c = (jnp.asarray(rng.standard_normal((9, n)), jnp.float32) for n in (16, 8))
    w = jnp.asarray(rng.standard_normal((3, 16, 8)), jnp.float32)

    def loss(x, w):
        return jnp.sum(c * grouped_matmul(x, w, sizes, impl=impl))

    def dense(x, w):
        y = jnp.einsum("md,mdf->mf", x, w[group])
        return jnp.sum(c[:7] * y[:7])

    for got, want in zip(jax.grad(loss, (0, 1))(x, w), jax.grad(dense, (0, 1))(x, w),
                         strict=True):
        assert_close(got, want)
