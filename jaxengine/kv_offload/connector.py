"""`OffloadingConnector`: the scheduler side of host offloading (docs/SCHEDULING.md §11).

The answers a `schedule()` call takes: a waiting request's blocks past the local prefix-cache
hit that the host store holds, consecutively, are loaded asynchronously (vLLM's
`OffloadingConnectorScheduler.get_num_new_matched_tokens`). Its methods only read the store,
which changes between steps only (in the worker's `start_step`), so they are pure as §11 asks.

Pages reach the store when the device is about to overwrite them (the plan's `evicted_blocks`),
not at finish: a freed cached block keeps its content on the device until it is reused, and the
scheduler reports every such reuse before the step that overwrites it, so saving then loses
nothing and copies only what leaves the device. `request_finished` therefore holds nothing
(vLLM stores each block as it fills and holds a finished request while a store runs;
`EagerSaveConnector` in the tests does the finish-time variant through the same worker).
"""

from __future__ import annotations

from jaxengine.kv_offload.host_store import HostKVStore
from scheduler import KVConnector, RequestView


class OffloadingConnector(KVConnector):
    """Loads the blocks a request's prefix hashes find in a `HostKVStore`."""

    def __init__(self, store: HostKVStore, block_size: int) -> None:
        """Args:
          store: the host pages (read only here).
          block_size: tokens per block (the scheduler's).
        """
        self.store = store
        self.block_size = block_size

    def get_num_new_matched_tokens(self, request: RequestView,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens of the whole blocks after the local hit that the store holds in a row, to
        load asynchronously; (0, False) when it holds none."""
        bs, store = self.block_size, self.store
        found = 0
        for block_hash in request.block_hashes[num_computed_tokens // bs:]:
            if block_hash not in store:
                break
            found += 1
        return (found * bs, True) if found else (0, False)
