"""`HostKVStore`: KV pages in host memory, keyed by their prefix-cache block hash (LRU).

A page's hash (scheduler/kv/hashing.py) names its whole prefix, so a page stored under it is valid
for any request whose block has that hash, as in the device's prefix cache (docs/SCHEDULING.md
§5). The store holds at most `capacity_bytes // page_bytes` pages; a new page beyond that
evicts the least recently used one (stored or loaded last = used last). vLLM's CPU offloading
keeps its pages the same way (`kv_offload/lru_manager.py`).

A page copied out of the device is entered at once, before its bytes have reached the host
(the copy runs behind the step in flight): its value is then a `PendingPage`, read on first
use or by `resolve()`, which the worker calls at its next step. Only membership counts for
lookups, so the scheduler's connector can answer from a store whose copies are in flight.
"""

from __future__ import annotations

from collections import OrderedDict

import jax
import numpy as np

from scheduler.kv.hashing import BlockHash


class PendingPages:
    """The pages of one device->host copy ([M, ...page] on the device), read once."""

    __slots__ = ("_device", "_host")

    def __init__(self, pages: jax.Array) -> None:
        self._device: jax.Array | None = pages
        self._host: np.ndarray | None = None

    @property
    def ready(self) -> bool:
        """Whether `host()` has been read (then it no longer waits)."""
        return self._host is not None

    def host(self) -> np.ndarray:
        """[M, ...page] on the host (waits for the copy the first time)."""
        if self._host is None:
            assert self._device is not None
            self._host, self._device = np.asarray(jax.device_get(self._device)), None
        return self._host


class PendingPage:
    """Row `index` of a `PendingPages`: a page whose copy to the host may still run."""

    __slots__ = ("index", "pages")

    def __init__(self, pages: PendingPages, index: int) -> None:
        self.pages = pages
        self.index = index

    def read(self) -> np.ndarray:
        """The page (a copy of its own, so the copy's other pages can be freed)."""
        return np.array(self.pages.host()[self.index])


class HostKVStore:
    """An LRU of KV pages by block hash, bounded in bytes."""

    def __init__(self, capacity_bytes: int, page_bytes: int) -> None:
        """Args:
          capacity_bytes: the most bytes of pages held (`kv_offloading_size` GiB).
          page_bytes: one page, all layers, every KV head (the whole model's, not a shard's).
        Raises:
          ValueError: the capacity holds no page.
        """
        self.page_bytes = page_bytes
        self.capacity_pages = capacity_bytes // page_bytes
        if self.capacity_pages < 1:
            raise ValueError(
                f"kv_offloading_size holds no KV block: {capacity_bytes} bytes, and one block "
                f"takes {page_bytes} bytes; raise kv_offloading_size to at least "
                f"{page_bytes / 2**30:.3g} GiB, or leave it unset to turn offloading off")
        self._pages: OrderedDict[BlockHash, np.ndarray | PendingPage] = OrderedDict()
        self._pending: list[BlockHash] = []  # put as PendingPage since the last resolve()
        self.evictions = 0  # pages dropped to make room, over the store's life

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    @property
    def num_bytes(self) -> int:
        """Bytes of the pages held (at most the capacity)."""
        return len(self._pages) * self.page_bytes

    @property
    def usage(self) -> float:
        """Pages held / pages it can hold."""
        return len(self._pages) / self.capacity_pages

    def get(self, block_hash: BlockHash) -> np.ndarray:
        """The page stored under `block_hash`, now the most recently used.

        Raises:
          KeyError: nothing is stored under it.
        """
        page = self._pages[block_hash]
        if isinstance(page, PendingPage):
            page = self._pages[block_hash] = page.read()
        self._pages.move_to_end(block_hash)
        return page

    def touch(self, block_hash: BlockHash) -> None:
        """Mark a stored page used now (e.g. the device has just reused it)."""
        self._pages.move_to_end(block_hash)

    def put(self, block_hash: BlockHash, page: np.ndarray | PendingPage) -> None:
        """Store a page (most recently used), evicting the least recently used beyond the
        capacity. A hash already stored keeps its page: equal hashes mean equal content."""
        if block_hash in self._pages:
            self._pages.move_to_end(block_hash)
            return
        self._pages[block_hash] = page
        if isinstance(page, PendingPage):
            self._pending.append(block_hash)
        while len(self._pages) > self.capacity_pages:
            self._pages.popitem(last=False)
            self.evictions += 1

    def resolve(self) -> None:
        """Take in every page whose copy has reached the host (`PendingPages.host()` was
        read; the copies' device buffers are freed once all their pages are taken in or
        evicted); the others stay pending. Costs the pending pages, not the store's size."""
        pending = []
        for block_hash in self._pending:
            page = self._pages.get(block_hash)
            if isinstance(page, PendingPage):
                if page.pages.ready:
                    self._pages[block_hash] = page.read()
                else:
                    pending.append(block_hash)
        self._pending = pending
