"""The native CPU kernel: random batches against the numpy oracle, its work units, the build
cache, the cache updated in place in a model-shaped step, the fallback without a compiler, and
the build for each x86 ISA level the CPU runs: against the oracle, and what a decode and a
prefill chunk share, to the bit where the head dim is under the vector width.

The grid against the reference (page sizes, head dims, GQA ratios, float32 / bfloat16) and the
garbage tests run it beside the other kernels (test_kernels.py, test_garbage.py).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxengine_kernels
from jaxengine_kernels.cpu import native, ragged_paged_attention_cpu
from jaxengine_kernels.reference import write_kv
from tests.jaxengine_kernels.cases import (
    PROP_SM_SCALE,
    check_random_batch,
    make_case,
    numpy_oracle,
    random_batches,
)


@jax.jit
def _fixed(*args):  # one compilation for every property example (the shapes are fixed)
    return ragged_paged_attention_cpu(*args, sm_scale=PROP_SM_SCALE, block_q=3,
                                      pages_per_split=2)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=random_batches(), seed=st.integers(0, 2**16))
def test_property_random_batches_match_numpy_oracle(reqs, seed):
    # block_q 3 and 2 pages per split: prefills cut into many units, decodes and short chunks
    # (<= 8 tokens) split over pages and merged.
    out = check_random_batch(_fixed, reqs, seed)
    assert not out[sum(q for q, _ in reqs):].any()  # padding rows are zeros


@pytest.mark.parametrize("head_dim", [8, 24, 64, 80, 128])
def test_head_dims_off_the_vector_width(head_dim):
    # The value product works on 16 and 64 columns at a time; 8, 24 and 80 leave tails.
    case = make_case([(1, 300), (37, 37), (5, 90)], num_heads=6, num_kv_heads=2,
                     head_dim=head_dim, page_size=16, seed=head_dim)
    out, _ = ragged_paged_attention_cpu(*case.args(jnp.float32), sm_scale=case.sm_scale)
    want, _ = numpy_oracle(case)
    np.testing.assert_allclose(np.asarray(out)[: case.num_tokens], want, atol=2e-5, rtol=2e-5)


def _last_token_whole_and_after_its_cache(attention, H: int) -> tuple[np.ndarray, np.ndarray]:
    """The last token's output [N, H] of a 23-token prompt attended whole (a prefill chunk:
    transposed scores) and as its last 3 tokens over the 20 cached (a decode-sized unit:
    row-major scores), one kv head per query head."""
    N, K, L, P = 4, 4, 4, 16
    rng = np.random.default_rng(H)
    cache = jnp.asarray(rng.standard_normal((P, L, 2 * K, H), np.float32))
    q = rng.standard_normal((23, N, H)).astype(np.float32)
    tables = np.zeros((2, 8), np.int32)
    tables[0, :6] = np.arange(1, 7)

    def last_row(rows: np.ndarray) -> np.ndarray:
        n = len(rows)
        qq = np.zeros((32, N, H), np.float32)
        qq[:n] = rows
        out = attention(jnp.asarray(qq), cache, jnp.asarray(tables),
                        jnp.asarray([23, 0], jnp.int32), jnp.asarray([0, n, n], jnp.int32),
                        jnp.asarray(1, jnp.int32), sm_scale=H**-0.5, block_q=32,
                        pages_per_split=32)
        return np.asarray(out)[n - 1]

    return last_row(q), last_row(q[20:])


# "native": the library this process loaded; the x86 levels: their own builds (where the CPU
# runs them), and the floats per vector of each.
ISAS = ["native", *native.X86_ISAS]
LANES = {"avx512": 16, "avx2": 8, "sse2": 4}


@pytest.mark.parametrize("isa", ISAS)
def test_a_head_dim_under_the_vector_gives_a_prompt_and_its_uncached_tail_the_same_bits(
        isa, isa_attention):
    """Under the build's vector width (head dim 3, under every build's, and the widest under
    this build's) a decode's dots of each key sum over h in order, as a prefill chunk's
    transposed scores do; the softmax sums and P.V run in key order on both paths, so the last
    token's output is the same, bit for bit. An echoed request with logprobs and a
    prefix-cached plain one then report the same completion logprobs where the model's head
    dim is under the vector width (tests/jaxengine/server/test_prompt_logprobs.py)."""
    lanes = native.vector_lanes() if isa == "native" else LANES[isa]
    for head_dim in sorted({3, lanes - 1}):
        whole, tail = _last_token_whole_and_after_its_cache(isa_attention(isa), H=head_dim)
        np.testing.assert_array_equal(whole, tail, err_msg=f"head dim {head_dim}")


@pytest.mark.parametrize("isa", ISAS)
def test_a_real_head_dim_gives_a_prompt_and_its_uncached_tail_float32_rounding_apart(
        isa, isa_attention):
    """From the vector width up, a decode sums each dot as a vector of partial sums and then
    a tree (group_dots), a prefill chunk over h in order: the two round apart, by at most
    6e-7 on outputs of about 1 at head dim 64 (20 seeds, every build here)."""
    whole, tail = _last_token_whole_and_after_its_cache(isa_attention(isa), H=64)
    np.testing.assert_allclose(whole, tail, rtol=0, atol=1e-6)


def test_a_long_decode_split_over_many_units_matches_one_unit():
    # pages_per_split 1: 125 partial softmax states merged; against no split at all.
    case = make_case([(1, 2000), (2, 1500), (1, 3)], num_heads=8, num_kv_heads=2, head_dim=64,
                     page_size=16, seed=5)
    args = case.args(jnp.float32)
    split, _ = ragged_paged_attention_cpu(*args, sm_scale=case.sm_scale, pages_per_split=1)
    whole, _ = ragged_paged_attention_cpu(*args, sm_scale=case.sm_scale, pages_per_split=1000)
    want, _ = numpy_oracle(case)
    T = case.num_tokens
    np.testing.assert_allclose(np.asarray(split)[:T], want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(split)[:T], np.asarray(whole)[:T], atol=1e-6)


def test_the_step_calls_the_kernel_and_updates_the_cache_in_place():
    """In a donated two-layer step laid out as the model's (one cache viewed as layers * P
    pages, each layer's K/V computed from the layer before), the kernel reads the pages where
    the scatter wrote them: no copy of the cache. (Were layer 2's K/V independent of layer 1,
    XLA could write them before layer 1's kernel reads the pages, and would copy to allow it.)
    """
    layers, P, L, K, N, H, T = 2, 64, 4, 2, 4, 8, 16

    def step(kv, q, k, v, slots, tables, seq_lens, qsl, num_seqs):
        pages = kv.reshape(layers * P, L, 2 * K, H)
        for i in range(layers):
            o, pages = ragged_paged_attention_cpu(q, k, v, pages, slots + i * P * L,
                                                  tables + i * P, seq_lens, qsl, num_seqs,
                                                  sm_scale=0.3)  # fmt: skip
            q = q + o
            k, v = k + o[:, :K], v - o[:, K:]
        return pages.reshape(kv.shape), q

    f32, i32 = jnp.float32, jnp.int32
    shapes = [((layers, P, L, 2 * K, H), f32), ((T, N, H), f32), ((T, K, H), f32),
              ((T, K, H), f32), ((T,), i32), ((8, 16), i32), ((8,), i32), ((9,), i32),
              ((), i32)]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    hlo = jax.jit(step, donate_argnames=("kv",)).lower(*args).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    assert entry.count(f'custom_call_target="{native.ATTENTION_TARGET[0]}"') == layers
    whole = (f"f32[{layers * P},{L},{2 * K},{H}]", f"f32[{layers},{P},{L},{2 * K},{H}]",
             f"f32[{layers * P * L},{2 * K},{H}]")
    copies = [ln for ln in entry.splitlines()
              if " copy(" in ln and any(f"= {w}" in ln for w in whole)]
    assert copies == []


def test_the_build_is_cached_by_what_the_binary_depends_on(tmp_path, monkeypatch):
    monkeypatch.setenv(native.ENV_CACHE, str(tmp_path))
    cxx, quick = native._compiler(), ("-O0",)  # unoptimised: the cache is what is tested
    first = native._build(cxx, quick)
    assert first.is_relative_to(tmp_path) and first.exists()
    stamp = first.stat().st_mtime_ns
    assert native._build(cxx, quick) == first and first.stat().st_mtime_ns == stamp  # reused
    other = native._build(cxx, (*quick, "-DJAXENGINE_TEST_FLAG"))  # other flags: another binary
    assert other != first and other.exists()
    assert [p.suffix for p in tmp_path.rglob("*") if p.is_file()] == [".so", ".so"]  # no temps


def test_without_a_compiler_the_default_is_the_reference_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv("CXX", "")
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(native, "_library", [])  # as in a process that has not loaded it
    native.available.cache_clear()
    monkeypatch.setattr(jaxengine_kernels.attention, "_warned_unavailable", False)
    try:
        with caplog.at_level(logging.WARNING, logger="jaxengine.kernels"):
            assert jaxengine_kernels.default_impl("cpu") == "reference"
        assert "no C++ compiler found" in caplog.text
        with pytest.raises(native.NativeBuildError, match="no C\\+\\+ compiler"):
            native.target(jnp.float32)
    finally:
        native.available.cache_clear()


def test_other_cache_dtypes_are_refused_by_name():
    with pytest.raises(ValueError, match="float8_e4m3fn, float8_e5m2, got float16"):
        native.target(jnp.float16)
    case = make_case([(1, 5)], num_heads=2, num_kv_heads=1, head_dim=8, page_size=4)
    q, k, v, cache, *rest = case.args(jnp.float32)
    with pytest.raises(ValueError, match="float8_e5m2, got int8"):
        ragged_paged_attention_cpu(q, k, v, cache.astype(jnp.int8), *rest, sm_scale=1.0)


@pytest.mark.parametrize(("window", "soft_cap"), [(0, None), (37, 0.5)])
@pytest.mark.parametrize("isa", native.X86_ISAS)
def test_every_isa_build_matches_the_oracle(isa, isa_attention, window, soft_cap):
    """The kernel built for AVX-512 (16-float vectors), AVX2 (8, register blocks of 4 keys x
    3 vectors and 3 P.V rows) and baseline SSE2 (4): the blocking changes with the ISA, the
    results must not, with a sliding window and soft-capping too (NaN before every window).
    Each runs where the CPU can execute it; the others are skipped, naming the missing CPU
    flags."""
    case = make_case([(1, 300), (70, 70), (9, 140), (3, 16)], num_heads=6, num_kv_heads=2,
                     head_dim=80, page_size=16, seed=11, sliding_window=window)
    q, k, v, cache, slots, tables, seq_lens, qsl, num_seqs = case.args(jnp.float32)
    cache = write_kv(cache, k, v, slots)
    out = isa_attention(isa)(q, cache, tables, seq_lens, qsl, num_seqs, sm_scale=case.sm_scale,
                             block_q=32, pages_per_split=4, sliding_window=window,
                             soft_cap=soft_cap or 0.0)
    want, _ = numpy_oracle(case, sliding_window=window, soft_cap=soft_cap)
    np.testing.assert_allclose(np.asarray(out)[: case.num_tokens], want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("isa", native.X86_ISAS)
def test_every_isa_build_reads_narrow_caches(isa, isa_attention, cache_dtype):
    """Each ISA level's build widens bfloat16 and fp8 cache rows (vector code with a scalar
    tail at head dim 80) to the values the reference reads from the same cache."""
    case = make_case([(1, 300), (70, 70), (3, 16)], num_heads=6, num_kv_heads=2, head_dim=80,
                     page_size=16, seed=12)
    q, k, v, cache, slots, tables, seq_lens, qsl, num_seqs = case.args(jnp.float32)
    cache = write_kv(cache.astype(cache_dtype), k, v, slots)
    out = isa_attention(isa)(q, cache, tables, seq_lens, qsl, num_seqs, sm_scale=case.sm_scale,
                             block_q=32, pages_per_split=4)
    want, _ = jaxengine_kernels.ragged_paged_attention(
        q, k, v, cache, slots, tables, seq_lens, qsl, num_seqs, sm_scale=case.sm_scale)
    T = case.num_tokens
    np.testing.assert_allclose(np.asarray(out)[:T], np.asarray(want)[:T], atol=2e-5, rtol=2e-5)


def test_vmap_runs_the_kernel_per_element():
    """Research code may vmap a step over a batch of queries: each element is the kernel's own
    call (vmap_method="sequential")."""
    case = make_case([(1, 40), (9, 30)], num_heads=4, num_kv_heads=2, head_dim=16, page_size=8)
    q, *rest = case.args(jnp.float32)
    qs = jnp.stack([q, 2 * q])
    outs, _ = jax.vmap(lambda qq: ragged_paged_attention_cpu(qq, *rest, sm_scale=0.3))(qs)
    for i in range(2):
        one, _ = ragged_paged_attention_cpu(qs[i], *rest, sm_scale=0.3)
        np.testing.assert_array_equal(np.asarray(outs[i]), np.asarray(one))
    assert not np.allclose(np.asarray(outs[0]), np.asarray(outs[1]))
