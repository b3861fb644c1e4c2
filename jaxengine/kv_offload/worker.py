"""`OffloadingWorker`: the device side of host offloading, the `KVWorker` the engine calls
around a step (`jaxengine/kv_connector`).

Each plan's `kv_connector_metadata` (docs/SCHEDULING.md §11) is carried out in `start_step`,
before the plan's model step is dispatched, in this order:

1. the device->host copies dispatched two steps ago or earlier are read into the store (the
   steps they were queued before have been collected since, so this does not wait; one
   dispatched by the step before may still queue behind the step in flight under async
   scheduling, and a load that needs it reads it at once);
2. the pages of each load are read from the store on the host (before anything is stored, so
   the LRU cannot drop a page the scheduler was just told about);
3. the plan's `evicted_blocks`, and the blocks of its `saves`, that the store lacks are
   gathered on the device and their copy to the host started. The gather reads the pool that
   the step then donates, and JAX lets a buffer's pending reads finish before a program that
   was donated it overwrites it, so the gather sees the blocks as they were;
4. the loads are scattered into their freshly allocated blocks (in place, the pool donated):
   its output is the pool every later step reads.

Loads are reported in `finished_recving` and saves in `finished_sending` of the next
`take_output()`: by data dependence they come before any later step on the device, so the
next update may report them. Synchronous and asynchronous scheduling take the same path; under
async scheduling the copies simply queue behind the step in flight.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from jaxengine.kv_connector import KVWorker
from jaxengine.kv_offload.connector import OffloadingConnector
from jaxengine.kv_offload.copies import BLOCKS_PER_COPY, BlockCopier
from jaxengine.kv_offload.host_store import HostKVStore, PendingPage, PendingPages
from scheduler import KVConnectorOutput, KVLoad, SchedulerOutput, SchedulerState
from scheduler.kv.hashing import BlockHash, extend_block_hashes

if TYPE_CHECKING:
    from jaxengine.engine.stats import IterationStats
    from jaxengine.runner.runner import Runner

SAVE, LOAD = "GPU_to_CPU", "CPU_to_GPU"  # vLLM's transfer_type labels (device -> host: save)


@dataclass(frozen=True, slots=True, kw_only=True)
class KVTransferStats:
    """One copy of KV blocks between the device and host memory (vLLM's offloading op)."""

    transfer_type: str  # SAVE (device to host) or LOAD (host to device)
    num_bytes: int
    seconds: float  # host time spent on it: dispatching it, and waiting for it


class OffloadingWorker(KVWorker):
    """Host offloading for one engine: the store, its connector and the device copies."""

    records_stats = True  # its transfers and the store's usage go into every step's stats

    def __init__(self, runner: Runner, *, capacity_bytes: int, block_size: int,
                 page_axis: int) -> None:
        """Compile the copy programs for the runner's pool and make an empty store.

        Args:
          runner: whose `kv` pool is copied (read, and replaced after a load).
          capacity_bytes: the store's size (`kv_offloading_size` GiB).
          block_size: tokens per block.
          page_axis: the pool's axis of pages (`ModelFns.kv_page_axis`).
        Raises:
          ValueError: the capacity holds no block (the message names kv_offloading_size).
        """
        self.runner = runner
        self.block_size = block_size
        self.copier = BlockCopier(runner.kv, page_axis=page_axis)
        self.store = HostKVStore(capacity_bytes, self.copier.page_bytes)
        self.connector = OffloadingConnector(self.store, block_size)
        self._recving: set[str] = set()  # loads started, not reported yet
        self._sending: set[str] = set()  # saves done, not reported yet
        self._steps = 0  # start_step calls
        self._in_flight: list[tuple[PendingPages, int, float, int]] = []  # copies out:
        # pages, bytes, seconds spent dispatching, the start_step that dispatched them
        self._transfers: list[KVTransferStats] = []  # not yet handed to a step's stats

    def start_step(self, plan: SchedulerOutput, state: SchedulerState, *, idle: bool) -> None:
        """Carry out a plan's transfers before its model step is dispatched.

        Args:
          plan: the step's plan (nothing to do unless it has `kv_connector_metadata`).
          state: the state `schedule()` returned with it (the loading requests' tokens).
          idle: unused: the copies never wait for anything outside the engine.
        """
        meta = plan.kv_connector_metadata
        if meta is None:
            return
        self._steps += 1
        self._read_copies_out()
        loads = [(load, self._pages_to_load(load, state)) for load in meta.loads]
        out: list[tuple[int, BlockHash]] = list(meta.evicted_blocks)
        for save in meta.saves:
            out += zip(save.block_ids, save.block_hashes, strict=False)  # its full blocks
        self._copy_out(out)
        self._copy_in([(b, page) for load, pages in loads
                       for b, page in zip(self._load_targets(load), pages, strict=True)])
        self._recving.update(load.req_id for load in meta.loads if load.load_async)
        self._sending.update(save.req_id for save in meta.saves)

    def take_output(self) -> KVConnectorOutput | None:
        """The loads and saves finished since the last call, for `update_from_output` (None:
        nothing to report)."""
        if not (self._recving or self._sending):
            return None
        out = KVConnectorOutput(finished_recving=frozenset(self._recving),
                                finished_sending=frozenset(self._sending))
        self._recving, self._sending = set(), set()
        return out

    def record(self, stats: IterationStats) -> None:
        """Add the transfers since the last call, and the store's usage, to a step's stats."""
        stats.kv_offload_transfers.extend(self._transfers)
        self._transfers = []
        stats.kv_offload_usage = self.store.usage

    def check_update_weights(self) -> None:
        """Refused: the host store would serve KV of the old weights."""
        raise ValueError("update_weights is not supported with kv_offloading_size (the "
                         "host KV store would serve KV of the old weights); build the "
                         "engine without KV offloading")

    # ---- the copies --------------------------------------------------------------------

    def _load_targets(self, load: KVLoad) -> Sequence[int]:
        first = load.num_computed_tokens // self.block_size
        return load.block_ids[first:first + load.num_external_tokens // self.block_size]

    def _pages_to_load(self, load: KVLoad, state: SchedulerState) -> list[np.ndarray]:
        """The host pages of a load's blocks, by the request's block hashes."""
        bs = self.block_size
        first = load.num_computed_tokens // bs
        req = state.requests[load.req_id]
        tokens = req.prompt_token_ids + req.output_token_ids
        count = first + load.num_external_tokens // bs
        hashes = extend_block_hashes([], tokens, count, bs, req.cache_salt,
                                     lora_name=req.lora_name)[first:]
        return [self.store.get(h) for h in hashes]

    def _copy_out(self, blocks: Iterable[tuple[int, BlockHash]]) -> None:
        """Gather the blocks the store lacks and enter them (their copy runs meanwhile)."""
        todo: dict[BlockHash, int] = {}
        for block, block_hash in blocks:
            if block_hash in self.store:
                self.store.touch(block_hash)
            else:
                todo.setdefault(block_hash, block)
        items = list(todo.items())
        for start in range(0, len(items), BLOCKS_PER_COPY):
            chunk = items[start:start + BLOCKS_PER_COPY]
            t0 = time.perf_counter()
            pending = PendingPages(self.copier.gather(
                self.runner.kv, np.array([b for _, b in chunk], np.int32)))
            for i, (block_hash, _) in enumerate(chunk):
                self.store.put(block_hash, PendingPage(pending, i))
            self._in_flight.append((pending, len(chunk) * self.copier.page_bytes,
                                    time.perf_counter() - t0, self._steps))

    def _read_copies_out(self) -> None:
        """Read the copies out dispatched two steps ago or earlier (timed) into the store."""
        later = []
        for pending, num_bytes, seconds, step in self._in_flight:
            if step > self._steps - 2:
                later.append((pending, num_bytes, seconds, step))
                continue
            t0 = time.perf_counter()
            pending.host()
            self._transfers.append(KVTransferStats(
                transfer_type=SAVE, num_bytes=num_bytes,
                seconds=seconds + time.perf_counter() - t0))
        self._in_flight = later
        self.store.resolve()

    def _copy_in(self, pages: list[tuple[int, np.ndarray]]) -> None:
        """Scatter host pages into their blocks, M at a time (the pool is replaced)."""
        for start in range(0, len(pages), BLOCKS_PER_COPY):
            chunk = pages[start:start + BLOCKS_PER_COPY]
            t0 = time.perf_counter()
            self.runner.kv = self.copier.scatter(
                self.runner.kv, np.array([b for b, _ in chunk], np.int32),
                np.stack([p for _, p in chunk]))
            self._transfers.append(KVTransferStats(
                transfer_type=LOAD, num_bytes=len(chunk) * self.copier.page_bytes,
                seconds=time.perf_counter() - t0))
