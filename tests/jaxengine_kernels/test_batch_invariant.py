"""Batch invariance of the native CPU kernels: a row's bits do not depend on what is beside it.

The packed matmul sums each output's K products in K's order whatever the row count or the
row's place among the row blocks, chunked units and runs. The attention kernel with
batch_invariant gives a token the same output whatever chunk its request's tokens came in (a
decode, the whole prompt, the tail after a cached prefix, a budget's cut, block_q) and
whatever requests share the step; without it a decode-sized chunk sums its dots in another
order (tests/jaxengine/engine/test_batch_invariant.py runs the engine on both). With a
sliding window (and soft-capping) too: a chunk's first key moves with its first token, the
kernel's key tiles do not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine_kernels.cpu import ragged_paged_attention_cpu
from jaxengine_kernels.cpu.matmul import pack, pack_swiglu, packed_matmul, packed_swiglu

# Around the kernel's row blocks (6), chunked units (7-64 rows) and runs (96).
ROW_COUNTS = [1, 2, 5, 6, 7, 49, 64, 65, 96, 97, 2048]


@pytest.mark.parametrize("glu", [False, True])
def test_a_packed_matmul_row_does_not_depend_on_the_row_count(glu: bool) -> None:
    K, N = 576, 192
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2048 + 5, K), np.float32))
    if glu:
        panels = pack_swiglu(*rng.standard_normal((2, K, N), np.float32))
        product = jax.jit(lambda x, live: packed_swiglu(x, panels, N, live))
    else:
        panels = pack(rng.standard_normal((K, N), np.float32))
        product = jax.jit(lambda x, live: packed_matmul(x, panels, N, live))
    # vmap runs the kernel once per row: every row computed alone.
    alone = np.asarray(jax.vmap(lambda row: product(row[None], 1)[0])(x))
    for m in ROW_COUNTS:
        for first in (0, 1, 5):  # the same rows at other places in the blocks
            got = np.asarray(product(x[first:first + m], m))
            np.testing.assert_array_equal(got, alone[first:first + m], err_msg=f"{m} rows")
    got = np.asarray(product(x[:64], 49))  # an engine step's padding rows are not computed
    np.testing.assert_array_equal(got[:49], alone[:49])


# SmolLM2's heads: 9 query heads, 3 KV heads of 64 (vector-wide dots), 16-token pages.
N, K, H, L = 9, 3, 64, 16
CONTEXT = 700  # 44 pages: a decode over them splits into runs of 32 pages by default
PAGES = -(-CONTEXT // L)
REQUESTS = 5


def _attend(chunks: list[tuple[int, int, int]], *, batch_invariant: bool, block_q: int = 32,
            num_tokens: int = 1024, sliding_window: int = 0,
            soft_cap: float | None = None) -> list[np.ndarray]:
    """Outputs of request r's tokens [start, stop) for each chunk (r, start, stop), all in one
    step. Every request's context is cached already (its keys are written to block 0 here):
    request r < REQUESTS holds its own pages of one random cache, and its own queries."""
    rng = np.random.default_rng(0)
    cache = jnp.asarray(rng.standard_normal((1 + REQUESTS * PAGES, L, 2 * K, H), np.float32))
    q_all = rng.standard_normal((REQUESTS, CONTEXT, N, H)).astype(np.float32)
    tables = np.zeros((len(chunks) + 1, PAGES), np.int32)
    q = np.zeros((num_tokens, N, H), np.float32)
    seq_lens, starts = np.zeros(len(chunks) + 1, np.int32), [0]
    for i, (r, start, stop) in enumerate(chunks):
        tables[i] = 1 + r * PAGES + np.arange(PAGES)
        q[starts[-1]:starts[-1] + stop - start] = q_all[r, start:stop]
        seq_lens[i] = stop
        starts.append(starts[-1] + stop - start)
    qsl = np.asarray(starts + [starts[-1]], np.int32)
    new_kv = jnp.zeros((num_tokens, K, H), jnp.float32)
    out, _ = ragged_paged_attention_cpu(
        jnp.asarray(q), new_kv, new_kv, cache, jnp.zeros(num_tokens, jnp.int32),
        jnp.asarray(tables), jnp.asarray(seq_lens), jnp.asarray(qsl),
        jnp.asarray(len(chunks), jnp.int32), sm_scale=H**-0.5, block_q=block_q,
        batch_invariant=batch_invariant, sliding_window=sliding_window, soft_cap=soft_cap)
    out = np.asarray(out)
    return [out[a:b] for a, b in zip(starts, starts[1:], strict=False)]


@pytest.mark.parametrize(("window", "soft_cap"), [(0, None), (100, None), (77, 0.5)])
@pytest.mark.parametrize(("start", "stop"), [
    (699, 700), (698, 700), (695, 700), (692, 700), (660, 700),  # tails after a cached prefix
    (0, 700), (37, 41), (100, 164), (3, 4), (64, 65),  # chunks a token budget cuts, decodes
])
def test_an_invariant_token_has_the_same_bits_in_any_chunk(start: int, stop: int, window: int,
                                                           soft_cap: float | None) -> None:
    mode = dict(batch_invariant=True, sliding_window=window, soft_cap=soft_cap)
    [whole] = _attend([(0, 0, CONTEXT)], **mode)
    # Among other requests (prefill chunks, decodes, one over a long context), in another
    # token bucket and at another row.
    mates = [(1, 0, 300), (2, 41, 42), (3, 600, 700), (4, 699, 700)]
    outs = _attend(mates[:2] + [(0, start, stop)] + mates[2:], num_tokens=2048, **mode)
    np.testing.assert_array_equal(outs[2], whole[start:stop])
    [small_blocks] = _attend([(0, start, stop)], block_q=7, **mode)
    np.testing.assert_array_equal(small_blocks, whole[start:stop])


def test_without_it_a_decode_sized_chunk_sums_its_dots_otherwise() -> None:
    [whole] = _attend([(0, 0, CONTEXT)], batch_invariant=False)
    [tail] = _attend([(0, 698, 700)], batch_invariant=False)
    np.testing.assert_allclose(tail, whole[698:], atol=1e-6)
    assert not np.array_equal(tail, whole[698:])
