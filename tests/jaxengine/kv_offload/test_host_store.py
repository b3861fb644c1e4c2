"""The host store (LRU by block hash, bounded in bytes) and the two device copy programs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.kv_offload import BLOCKS_PER_COPY, BlockCopier, HostKVStore
from jaxengine.kv_offload.copies import GATHER_NAME, SCATTER_NAME
from jaxengine.kv_offload.host_store import PendingPage, PendingPages
from jaxengine.runner.compiles import compile_count


def page(value: float) -> np.ndarray:
    return np.full((2, 3), value, np.float32)  # 24 bytes


def test_the_store_keeps_the_most_recently_used_pages_within_its_bytes() -> None:
    store = HostKVStore(capacity_bytes=3 * 24 + 23, page_bytes=24)  # room for 3 pages
    assert store.capacity_pages == 3
    for h in (b"a", b"b", b"c"):
        store.put(h, page(ord(h)))
    store.get(b"a")  # used: b is now the least recently used
    store.put(b"d", page(4.0))
    assert b"b" not in store and {b"a", b"c", b"d"} == {h for h in (b"a", b"c", b"d")
                                                        if h in store}
    assert (len(store), store.num_bytes, store.usage, store.evictions) == (3, 72, 1.0, 1)
    store.touch(b"c")
    store.put(b"a", page(-1.0))  # a hash names its content: the stored page stays
    np.testing.assert_array_equal(store.get(b"a"), page(ord("a")))
    store.put(b"e", page(5.0))  # d was used least recently (a and c since)
    assert b"d" not in store and len(store) == 3 and store.evictions == 2
    with pytest.raises(KeyError):
        store.get(b"d")


def test_a_store_too_small_for_one_block_names_the_argument() -> None:
    with pytest.raises(ValueError, match=r"kv_offloading_size holds no KV block: 100 bytes, "
                                         r"and one block takes 4096 bytes"):
        HostKVStore(capacity_bytes=100, page_bytes=4096)


def test_a_pending_page_is_read_once_and_owns_its_bytes() -> None:
    pending = PendingPages(jnp.arange(12.0).reshape(3, 4))
    store = HostKVStore(capacity_bytes=64, page_bytes=16)
    store.put(b"x", PendingPage(pending, 1))
    store.put(b"y", PendingPage(pending, 2))
    store.resolve()
    got = store.get(b"x")
    np.testing.assert_array_equal(got, [4.0, 5.0, 6.0, 7.0])
    assert got.base is None  # a copy: the other rows of the transfer can be freed
    store.put(b"z", PendingPage(PendingPages(jnp.ones((1, 4))), 0))
    for h in (b"p", b"q", b"r", b"s"):  # z is evicted before its copy is read
        store.put(h, np.zeros(4, np.float32))
    store.resolve()
    assert b"z" not in store and len(store) == 4


def pool() -> jnp.ndarray:
    """A [Ly, P, L, 2K, H] pool of distinct values (2 layers, 40 pages of 4 slots)."""
    return jnp.arange(2 * 40 * 4 * 4 * 2, dtype=jnp.float32).reshape(2, 40, 4, 4, 2)


def test_gather_then_scatter_moves_whole_pages_in_place() -> None:
    kv = pool()
    before = np.array(kv)  # a copy: a view of the buffer would keep it from being donated
    copier = BlockCopier(kv, page_axis=1)
    assert copier.page_bytes == 2 * 4 * 4 * 2 * 4
    compiled = compile_count(GATHER_NAME, SCATTER_NAME)
    out = np.asarray(copier.gather(kv, np.array([3, 7, 39], np.int32)))
    assert out.shape == (BLOCKS_PER_COPY, 2, 4, 4, 2)  # page axis first, padded
    np.testing.assert_array_equal(out[:3], before[:, [3, 7, 39]].transpose(1, 0, 2, 3, 4))
    pointer = kv.unsafe_buffer_pointer()
    new = copier.scatter(kv, np.array([10, 11, 12], np.int32), out[:3])
    assert new.unsafe_buffer_pointer() == pointer  # donated: updated in place
    after = np.asarray(new)
    np.testing.assert_array_equal(after[:, [10, 11, 12]], before[:, [3, 7, 39]])
    untouched = [b for b in range(1, 40) if b not in (10, 11, 12)]
    np.testing.assert_array_equal(after[:, untouched], before[:, untouched])
    assert compile_count(GATHER_NAME, SCATTER_NAME) == compiled  # compiled at construction

