"""Random ragged paged attention batches and a dumb per-request numpy oracle.

Every batch has shuffled block tables, garbage (NaN by default) in every KV slot that holds no
cached context before the step: pages no live request owns (block 0 included), the slots past
each request's context, and the slots this step's tokens are about to write (a recycled page
holds whatever its last owner left). It also has padding tokens that write into block 0 and
request rows past ``num_seqs`` with garbage metadata.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One batch: numpy inputs in the order of ``ragged_paged_attention``'s arguments."""

    q: np.ndarray  # [T, N, H]
    k: np.ndarray  # [T, K, H]
    v: np.ndarray  # [T, K, H]
    kv_cache: np.ndarray  # [P, L, 2*K, H]
    slot_mapping: np.ndarray  # i32[T]
    block_tables: np.ndarray  # i32[R, max_blocks]
    seq_lens: np.ndarray  # i32[R]
    query_start_loc: np.ndarray  # i32[R+1]
    num_seqs: np.ndarray  # i32[]
    sm_scale: float

    def args(self, dtype: jnp.dtype) -> tuple:
        """The arguments as jax arrays, floats cast to ``dtype``."""
        f = [jnp.asarray(a, dtype) for a in (self.q, self.k, self.v, self.kv_cache)]
        i = [
            jnp.asarray(a)
            for a in (
                self.slot_mapping,
                self.block_tables,
                self.seq_lens,
                self.query_start_loc,
                self.num_seqs,
            )
        ]
        return (*f, *i)

    @property
    def num_tokens(self) -> int:
        """Live (non-padding) tokens."""
        return int(self.query_start_loc[int(self.num_seqs)])


def make_case(
    reqs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pad_tokens: int = 3,
    pad_reqs: int = 2,
    extra_pages: int = 3,
    max_blocks: int | None = None,
    seed: int = 0,
    garbage: float | None = np.nan,
    sliding_window: int = 0,
) -> Case:
    """A batch of requests given as ``(q_len, context_len_after_step)`` pairs.

    ``q_len == 1`` is a decode, ``q_len == context_len`` a whole prefill, anything between a
    chunk of prefill (or a decode over a cached prefix). ``pad_tokens``, ``pad_reqs``,
    ``extra_pages`` and ``max_blocks`` (default: one more than the longest request needs) pad
    the shapes, e.g. to keep them fixed across cases. ``garbage`` fills every slot without
    cached context (``None`` leaves the random values there: the same case with a clean cache).
    With ``sliding_window`` W > 0 the context no query of the step sees (before each request's
    first query's window) counts as not cached: garbage too, as pages freed when they slid out
    of the window hold another request's data.
    """
    rng = np.random.default_rng(seed)
    N, K, H, L = num_heads, num_kv_heads, head_dim, page_size
    R = len(reqs) + pad_reqs
    q_lens = np.array([q for q, _ in reqs], np.int32)
    seq_lens = np.array([s for _, s in reqs], np.int32)
    assert np.all(q_lens <= seq_lens) and np.all(q_lens >= 1)
    n_pages = -(-seq_lens // L)
    max_blocks = max_blocks or int(n_pages.max()) + 1
    assert max_blocks >= n_pages.max()
    P = 1 + int(n_pages.sum()) + extra_pages  # page 0 is the null block
    perm = rng.permutation(np.arange(1, P)).astype(np.int32)
    block_tables = np.zeros((R, max_blocks), np.int32)
    off = 0
    for r, n in enumerate(n_pages):
        block_tables[r, :n] = perm[off : off + n]
        off += n
    # Garbage in rows past num_seqs: valid page ids that belong to live requests.
    block_tables[len(reqs) :] = rng.integers(0, P, (pad_reqs, max_blocks))
    T_live = int(q_lens.sum())
    T = T_live + pad_tokens
    qsl = np.zeros(R + 1, np.int32)
    qsl[1 : len(reqs) + 1] = np.cumsum(q_lens)
    qsl[len(reqs) + 1 :] = T_live
    seq_lens_all = np.concatenate([seq_lens, rng.integers(1, 50, pad_reqs).astype(np.int32)])

    kv = rng.standard_normal((P, L, 2 * K, H)).astype(np.float32)
    cached = np.zeros((P, L), bool)  # slots holding context from earlier steps
    for r, (q_len, s) in enumerate(reqs):
        first = max(s - q_len - sliding_window + 1, 0) if sliding_window else 0
        pos = np.arange(first, s - q_len)
        cached[block_tables[r, pos // L], pos % L] = True
    if garbage is not None:
        kv[~cached] = garbage
    slot = np.zeros(T, np.int32)
    for r in range(len(reqs)):
        pos = np.arange(seq_lens[r] - q_lens[r], seq_lens[r])
        slot[qsl[r] : qsl[r + 1]] = block_tables[r, pos // L] * L + pos % L
    slot[T_live:] = rng.integers(0, L, pad_tokens)  # padding -> block 0
    return Case(
        q=rng.standard_normal((T, N, H)).astype(np.float32),
        k=rng.standard_normal((T, K, H)).astype(np.float32),
        v=rng.standard_normal((T, K, H)).astype(np.float32),
        kv_cache=kv,
        slot_mapping=slot,
        block_tables=block_tables,
        seq_lens=seq_lens_all,
        query_start_loc=qsl,
        num_seqs=np.array(len(reqs), np.int32),
        sm_scale=float(H) ** -0.5,
    )


def numpy_oracle(
    case: Case, dtype: np.dtype = np.float32, *, sliding_window: int = 0,
    soft_cap: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per request, per token, the textbook formula (float64 math on ``dtype``-rounded inputs):
    the keys ``p - sliding_window < k <= p`` (all ``k <= p`` for 0), scores ``q.k * sm_scale``
    capped to ``soft_cap * tanh(s / soft_cap)`` when given, a dense softmax.

    Returns:
      ``(out [T_live, N, H], kv_cache [P, L, 2*K, H])``; the cache is the one the kernel must
      return, with padding tokens' writes into block 0 excluded (their order is unspecified).
    """
    rnd = [
        np.asarray(jnp.asarray(a, dtype).astype(jnp.float32), np.float64)
        for a in (case.q, case.k, case.v, case.kv_cache)
    ]
    q, k, v, kv = rnd
    P, L, K2, H = kv.shape
    K = K2 // 2
    N = q.shape[1]
    G = N // K
    T_live = case.num_tokens
    flat = kv.reshape(P * L, K2, H).copy()
    for t in range(T_live):
        flat[case.slot_mapping[t], 0::2] = k[t]
        flat[case.slot_mapping[t], 1::2] = v[t]
    out = np.zeros((T_live, N, H))
    qsl, bt = case.query_start_loc, case.block_tables
    for r in range(int(case.num_seqs)):
        s = int(case.seq_lens[r])
        pos = np.arange(s)
        ctx = flat[bt[r, pos // L] * L + pos % L]  # [S, 2K, H]
        for t in range(qsl[r], qsl[r + 1]):
            p = s - (qsl[r + 1] - t)
            lo = max(p - sliding_window + 1, 0) if sliding_window else 0
            for n in range(N):
                keys, vals = ctx[lo : p + 1, 2 * (n // G)], ctx[lo : p + 1, 2 * (n // G) + 1]
                logits = keys @ q[t, n] * case.sm_scale
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                w = np.exp(logits - logits.max())
                out[t, n] = (w / w.sum()) @ vals
    return out.astype(np.float32), flat.reshape(P, L, K2, H).astype(np.float32)


def assert_cache_equal(got: np.ndarray, want: np.ndarray) -> None:
    """Caches equal everywhere but block 0 (padding writes land there in unspecified order)."""
    np.testing.assert_array_equal(np.asarray(got, np.float32)[1:], want[1:])


# Fixed shapes for the property tests (of the reference, of the CPU kernel), so that hypothesis
# examples share one compilation. They fit the largest batch `random_batches` draws: 5 requests
# of up to 116 tokens, 29 pages each (+ page 0).
PROP_T, PROP_R, PROP_PAGES, PROP_MAX_BLOCKS, PROP_L = 96, 6, 150, 30, 4
PROP_SM_SCALE = 8**-0.5  # head_dim 8


@st.composite
def random_batches(draw: st.DrawFn) -> list[tuple[int, int]]:
    """1-5 requests: decodes, short chunks and whole prefills, and chunks over a cached prefix,
    fitting the PROP_* shapes."""
    reqs = draw(st.lists(st.tuples(st.integers(1, 16), st.integers(0, 100)), min_size=1,
                         max_size=PROP_R - 1))  # fmt: skip
    return [(q, q + cached) for q, cached in reqs]


def check_random_batch(attention: Callable[..., tuple[jax.Array, jax.Array]],
                       reqs: list[tuple[int, int]], seed: int) -> np.ndarray:
    """`attention` (an implementation compiled for the PROP_* shapes and PROP_SM_SCALE) against
    the numpy oracle on `reqs`: live rows and the cache. Returns its output, f32[PROP_T, 4, 8]."""
    T = sum(q for q, _ in reqs)
    pages = sum(-(-s // PROP_L) for _, s in reqs)
    case = make_case(
        reqs, num_heads=4, num_kv_heads=2, head_dim=8, page_size=PROP_L, seed=seed,
        pad_tokens=PROP_T - T, pad_reqs=PROP_R - len(reqs), extra_pages=PROP_PAGES - 1 - pages,
        max_blocks=PROP_MAX_BLOCKS,
    )  # fmt: skip
    assert case.sm_scale == PROP_SM_SCALE
    out, cache = attention(*case.args(jnp.float32))
    want, want_cache = numpy_oracle(case)
    np.testing.assert_allclose(np.asarray(out)[:T], want, atol=2e-5, rtol=2e-5)
    assert_cache_equal(np.asarray(cache), want_cache)
    return np.asarray(out)
