"""Garbage in KV slots that no query may attend to never reaches the output.

Every slot without cached context before the step holds NaN, +Inf or -Inf: pages no request
owns, the null block 0, the tail of each request's last page, and the slots this step's tokens
are about to write (which a kernel that attends before every write has landed must not read).
Each implementation must give finite outputs equal to its own output over the same case with
finite values in those slots. Masking by a multiply instead of a select fails this:
0 * NaN = NaN, 0 * Inf = NaN, Inf - Inf = NaN.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine_kernels import ragged_paged_attention
from tests.jaxengine_kernels.cases import Case, make_case

# (q_len, context_len): decodes, a prefill spanning three TPU q-blocks, chunks over a cached
# prefix, contexts ending mid-page.
REQS = [(1, 33), (20, 20), (9, 70), (1, 2), (3, 16)]
PAGE_SIZE = 16
# Small blocks so that the batch crosses q-block, kv-block and split boundaries.
IMPLS = {
    "reference": {},
    "cpu": {"block_q": 4, "pages_per_split": 2},
    "tpu": {"block_q": 8, "pages_per_block": 2},
    "gpu": {"num_splits": 3},
}
GARBAGE = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}


@functools.cache
def _case(garbage: float | None) -> Case:
    return make_case(REQS, num_heads=4, num_kv_heads=2, head_dim=64, page_size=PAGE_SIZE,
                     garbage=garbage)  # fmt: skip


@functools.cache
def _out(impl: str, garbage: float | None) -> np.ndarray:  # f32[T_live, N, H]
    case = _case(garbage)
    out, _ = ragged_paged_attention(*case.args(jnp.float32), sm_scale=case.sm_scale, impl=impl,
                                    interpret=True, **IMPLS[impl])  # fmt: skip
    return np.asarray(out)[: case.num_tokens]


def _is_garbage(kv: np.ndarray, garbage: float) -> np.ndarray:  # bool[..., 2*K, H] -> bool[...]
    hit = np.isnan(kv) if np.isnan(garbage) else kv == garbage
    return hit.all(axis=(-2, -1))


@pytest.mark.parametrize("garbage", GARBAGE)
def test_the_case_has_garbage_in_every_unattendable_slot(garbage: str) -> None:
    case = _case(GARBAGE[garbage])
    bad = _is_garbage(case.kv_cache, GARBAGE[garbage])  # bool[P, L]
    L = PAGE_SIZE
    live = {int(p) for r, (_, s) in enumerate(REQS) for p in case.block_tables[r, : -(-s // L)]}
    unused = sorted(set(range(1, bad.shape[0])) - live)
    assert bad[0].all()  # the null block
    assert unused and bad[unused].all()  # pages no live request owns
    for r, (q_len, s) in enumerate(REQS):
        pages = case.block_tables[r]
        assert bad[pages[(s - 1) // L], (s - 1) % L + 1 :].all()  # past the context, last page
        pos = np.arange(s - q_len)
        assert not bad[pages[pos // L], pos % L].any()  # the cached context itself is clean
    written = case.slot_mapping[: case.num_tokens]
    assert bad.reshape(-1)[written].all()  # the slots this step writes


@pytest.mark.parametrize("garbage", GARBAGE)
@pytest.mark.parametrize("impl", IMPLS)
def test_garbage_never_reaches_the_output(impl: str, garbage: str) -> None:
    out = _out(impl, GARBAGE[garbage])
    assert np.isfinite(out).all(), f"rows {np.flatnonzero(~np.isfinite(out).all(axis=(1, 2)))}"
    np.testing.assert_array_equal(out, _out(impl, None))
