"""The jnp reference against the dumb per-request numpy oracle."""

from __future__ import annotations

import itertools
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxengine_kernels
from jaxengine_kernels import ragged_paged_attention
from tests.jaxengine_kernels.cases import (
    PROP_SM_SCALE,
    assert_cache_equal,
    check_random_batch,
    make_case,
    numpy_oracle,
    random_batches,
)

# (q_len, context_len) per request.
BATCHES = {
    "decode": [(1, 5), (1, 40), (1, 17), (1, 1)],
    "prefill": [(23, 23), (7, 7), (40, 40)],
    "mixed": [(1, 33), (12, 12), (9, 50), (1, 2), (16, 16)],
}
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def run(case, dtype, **kw):
    out, cache = ragged_paged_attention(*case.args(dtype), sm_scale=case.sm_scale, **kw)
    return np.asarray(out.astype(jnp.float32)), np.asarray(cache.astype(jnp.float32))


# (batch, page_size, (q heads, kv heads), dtype); the default run takes a slice of the grid.
GRID = list(
    itertools.product(
        sorted(BATCHES), [4, 16], [(2, 2), (6, 2), (8, 1)], [jnp.float32, jnp.bfloat16]
    )
)
F32, BF16 = jnp.float32, jnp.bfloat16
REDUCED = [
    ("decode", 4, (8, 1), F32),
    ("decode", 16, (6, 2), BF16),
    ("mixed", 4, (6, 2), F32),
    ("mixed", 16, (8, 1), BF16),
    ("mixed", 16, (2, 2), F32),
    ("prefill", 4, (2, 2), BF16),
    ("prefill", 16, (8, 1), F32),
    ("prefill", 16, (6, 2), BF16),
]
PARAMS = [p if p in REDUCED else pytest.param(*p, marks=pytest.mark.slow) for p in GRID]


@pytest.mark.parametrize(("batch", "page_size", "heads", "dtype"), PARAMS)
def test_matches_numpy_oracle(batch, page_size, heads, dtype):
    num_heads, num_kv_heads = heads
    case = make_case(
        BATCHES[batch],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=8,
        page_size=page_size,
        seed=sorted(BATCHES).index(batch) * 100 + page_size,
    )
    out, cache = run(case, dtype, block_q=4, pages_per_chunk=2)
    want_out, want_cache = numpy_oracle(case, dtype)
    T = case.num_tokens
    assert np.all(np.isfinite(out[:T]))
    np.testing.assert_allclose(out[:T], want_out, atol=TOL[dtype], rtol=TOL[dtype])
    assert_cache_equal(cache, want_cache)


@pytest.mark.parametrize(
    ("block_q", "pages_per_chunk", "decode_pages_per_step"), [(1, 1, 1), (3, 5, 2), (64, 64, 64)]
)
def test_block_sizes_do_not_change_the_result(block_q, pages_per_chunk, decode_pages_per_step):
    case = make_case(BATCHES["mixed"], num_heads=4, num_kv_heads=2, head_dim=8, page_size=4)
    out, _ = run(
        case, jnp.float32, block_q=block_q, pages_per_chunk=pages_per_chunk,
        decode_pages_per_step=decode_pages_per_step,
    )  # fmt: skip
    want, _ = numpy_oracle(case)
    np.testing.assert_allclose(out[: case.num_tokens], want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("decode_pages_per_step", [3, 8, 12, 40])
def test_decode_steps_straddle_requests(decode_pages_per_step):
    # Page size 4, 38 live pages: steps of 3, 8 or 12 pages end inside requests and take the
    # start of the next; 40 holds them all. max_blocks 17 is no multiple of a step, and the
    # slots past each context are NaN.
    case = make_case([(1, 37), (1, 5), (1, 64), (1, 1), (1, 33)], num_heads=6, num_kv_heads=2,
                     head_dim=8, page_size=4, max_blocks=17, seed=5)  # fmt: skip
    out, _ = run(case, jnp.float32, decode_pages_per_step=decode_pages_per_step)
    want, _ = numpy_oracle(case)
    np.testing.assert_allclose(out[: case.num_tokens], want, atol=2e-5, rtol=2e-5)

def test_default_block_sizes_long_context():
    case = make_case(
        [(1, 700), (64, 300), (1, 1)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=16,
        seed=3,
    )
    out, _ = run(case, jnp.float32)
    want, _ = numpy_oracle(case)
    np.testing.assert_allclose(out[: case.num_tokens], want, atol=2e-5, rtol=2e-5)


def test_compiles_once_for_all_metadata():
    """All integer inputs are traced: new batches of the same shapes reuse the compilation."""
    shapes = dict(num_heads=4, num_kv_heads=2, head_dim=8, page_size=4, pad_reqs=1)
    # Same T, R, P and max_blocks; only the metadata (and the data) differ.
    a = make_case([(1, 9), (6, 6), (3, 12)], pad_tokens=2, **shapes)
    b = make_case([(5, 9), (2, 8), (3, 3)], pad_tokens=2, extra_pages=5, **shapes, seed=1)
    chex.assert_trees_all_equal_shapes_and_dtypes(a.args(jnp.float32), b.args(jnp.float32))

    @jax.jit
    @chex.assert_max_traces(n=1)  # a retrace for b's metadata raises inside the call
    def f(*args):
        return ragged_paged_attention(*args, sm_scale=a.sm_scale)

    for case in (a, b):
        out, cache = f(*case.args(jnp.float32))
        want, want_cache = numpy_oracle(case)
        np.testing.assert_allclose(np.asarray(out)[: case.num_tokens], want, atol=2e-5)
        assert_cache_equal(np.asarray(cache), want_cache)


def test_many_padding_request_rows():
    # max_num_seqs far above the live requests (and above T): the decode pass only looks at the
    # first min(R, T) rows, which must hold every live request.
    case = make_case([(1, 30), (1, 9), (5, 21), (1, 1)], num_heads=4, num_kv_heads=2,
                     head_dim=16, page_size=4, pad_tokens=2, pad_reqs=40)
    assert case.args(jnp.float32)[5].shape[0] > case.args(jnp.float32)[0].shape[0]  # R > T
    out, cache = run(case, jnp.float32)
    want_out, want_cache = numpy_oracle(case)
    np.testing.assert_allclose(out[: case.num_tokens], want_out, atol=2e-5, rtol=2e-5)
    assert_cache_equal(cache, want_cache)


def test_sm_scale_is_used():
    case = make_case(BATCHES["mixed"], num_heads=2, num_kv_heads=1, head_dim=8, page_size=4)
    out, _ = ragged_paged_attention(*case.args(jnp.float32), sm_scale=case.sm_scale)
    out2, _ = ragged_paged_attention(*case.args(jnp.float32), sm_scale=2 * case.sm_scale)
    T = case.num_tokens
    assert not np.allclose(np.asarray(out)[:T], np.asarray(out2)[:T])


def test_unknown_impl_is_rejected():
    case = make_case(BATCHES["decode"], num_heads=2, num_kv_heads=1, head_dim=8, page_size=4)
    with pytest.raises(ValueError, match="impl must be one of"):
        ragged_paged_attention(*case.args(jnp.float32), sm_scale=1.0, impl="cuda")


def test_default_impl_on_cpu():
    # The native kernel, which this machine (like every CI machine) can build.
    assert jax.default_backend() == "cpu"
    assert jaxengine_kernels.default_impl() == "cpu"


def test_reference_does_not_warn():
    case = make_case(BATCHES["decode"], num_heads=2, num_kv_heads=1, head_dim=8, page_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ragged_paged_attention(*case.args(jnp.float32), sm_scale=1.0)


def test_memory_is_bounded_for_8k_contexts():
    """Compiled (not run) at Llama-3-8B heads: 2048 tokens, 64 requests of 8k context.

    The naive [T, context, 2*K, H] gather would be 64 GiB in bfloat16; the reference's scratch
    must stay small (measured 56 MiB).
    """
    T, R, ctx, N, K, H, L = 2048, 64, 8192, 32, 8, 128, 16
    S, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    args = (
        S((T, N, H), bf16), S((T, K, H), bf16), S((T, K, H), bf16),
        S((R * ctx // L + 1, L, 2 * K, H), bf16), S((T,), i32), S((R, ctx // L), i32),
        S((R,), i32), S((R + 1,), i32), S((), i32),
    )  # fmt: skip
    f = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=H**-0.5), donate_argnums=(3,))
    memory = f.lower(*args).compile().memory_analysis()
    assert memory.temp_size_in_bytes < 128 * 2**20


# Small loop steps, so items and decodes straddle steps (the defaults fit these in one).
_reference_fixed = jax.jit(
    lambda *a: ragged_paged_attention(*a, sm_scale=PROP_SM_SCALE, block_q=4, pages_per_chunk=3,
                                      decode_pages_per_step=3)
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=random_batches(), seed=st.integers(0, 2**16))
def test_property_random_batches_match_numpy_oracle(reqs, seed):
    check_random_batch(_reference_fixed, reqs, seed)


def test_one_token_batch_matches_numpy_oracle():
    # T = 1 (the smallest token bucket) takes its own write path; garbage in every other slot.
    case = make_case([(1, 37)], num_heads=6, num_kv_heads=2, head_dim=8, page_size=4,
                     pad_tokens=0, pad_reqs=3)
    assert case.q.shape[0] == 1
    out, cache = run(case, jnp.float32)
    want_out, want_cache = numpy_oracle(case)
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=2e-5)
    assert_cache_equal(cache, want_cache)


def _cache_copies(num_tokens: int) -> int:
    """Copies of the whole cache in a donated two-layer step (the model's page layout)."""
    layers, P, L, K, N, H = 2, 64, 4, 2, 4, 8

    def step(kv, q, k, v, slots, tables, seq_lens, qsl, num_seqs):
        pages = kv.reshape(layers * P, L, 2 * K, H)
        for i in range(layers):  # layer i owns pages i*P .. (i+1)*P - 1
            o, pages = ragged_paged_attention(q, k, v, pages, slots + i * P * L,
                                              tables + i * P, seq_lens, qsl, num_seqs,
                                              sm_scale=0.3)
            q = q + o
        return pages.reshape(kv.shape), q

    f32, i32 = jnp.float32, jnp.int32
    shapes = [((layers, P, L, 2 * K, H), f32), ((num_tokens, N, H), f32),
              ((num_tokens, K, H), f32), ((num_tokens, K, H), f32), ((num_tokens,), i32),
              ((8, 16), i32), ((8,), i32), ((9,), i32), ((), i32)]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    hlo = jax.jit(step, donate_argnames=("kv",)).lower(*args).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    whole = (f"f32[{layers * P},{L},{2 * K},{H}]", f"f32[{layers},{P},{L},{2 * K},{H}]",
             f"f32[{layers * P * L},{2 * K},{H}]")
    return sum(" copy(" in line and any(f"= {w}" in line for w in whole)
               for line in entry.splitlines())


def test_one_token_step_updates_the_cache_in_place():
    # XLA on CPU turns a one-row scatter into fusions it duplicates, each with its own copy of
    # the whole cache (docs/BENCHMARKS.md §3), unless write_kv pads it. The write must cost no
    # more copies at one token than at two.
    assert _cache_copies(1) <= _cache_copies(2)
