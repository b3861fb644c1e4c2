"""`KVTransferWorker`: the engine side of prefill/decode disaggregation, the `KVWorker` the
engine calls around a step (`jaxengine/kv_connector`).

Producer (`kv_producer` / `kv_both`). A finished do_remote_decode request's blocks are held by
the scheduler; the worker notes them with a deadline when the engine builds the request's
output (`finish_request`), before the handle in it can reach a consumer. A consumer's pickup
arrives on the `TransferServer`'s thread and waits there; the engine's thread answers it in
`start_step`, before the step is dispatched: it gathers the pages (the offloading
code's `BlockCopier`, the pool not donated) and reports the request in `finished_sending` at
once, since JAX lets the gather's reads finish before a later step that was donated the pool
overwrites the blocks. The server's thread then copies the pages to the host and sends them.
Blocks nobody picks up are released the same way once `abort_timeout_s` has passed.
With the "jax" transport the producer cannot learn when a pull is served
(`device_transport`), so `finish_request` gathers the pages at once, offers them to its
`DeviceTransferServer` until `abort_timeout_s`, and the request is reported in
`finished_sending` with the plan that holds it: the pages wait outside the pool.

Consumer (`kv_consumer` / `kv_both`). Each asynchronous `KVLoad` of a plan starts a thread that
fetches the pages from the producer named in the request's handle (over TCP to the host, or,
"jax", pulled onto its devices). The engine's thread writes what arrived into the allocated
blocks in a later `start_step` (the scatter donates the pool, so only the step loop may) and
reports the request in `finished_recving`; a fetch that failed
reports its blocks in `invalid_block_ids` too, so the scheduler recomputes the prompt locally
(vLLM's default `kv_load_failure_policy`, "recompute").

An engine with nothing to compute but transfers to wait for calls `start_step` with `idle`:
it then waits (briefly) for a pickup or a fetch, rather than spinning through empty steps.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxengine.config import KVTransferConfig
from jaxengine.kv_connector import KVWorker
from jaxengine.kv_offload.copies import BLOCKS_PER_COPY, BlockCopier
from jaxengine.kv_transfer import params as transfer_params
from jaxengine.kv_transfer.connector import TransferConnector
from jaxengine.kv_transfer.device_transport import DeviceTransferServer
from jaxengine.kv_transfer.params import KVLayout, RemoteDecode, RemoteHandle
from jaxengine.kv_transfer.transport import TransferError, TransferServer, fetch_pages
from scheduler import KVConnectorOutput, KVLoad, SchedulerOutput, SchedulerState

if TYPE_CHECKING:
    from jaxengine.runner.runner import Runner

logger = logging.getLogger("jaxengine.kv_transfer")
IDLE_WAIT_S = 0.01  # the longest an idle engine waits in start_step for a transfer


@dataclass(frozen=True, slots=True)
class _Pickup:
    request_id: str
    first_block: int
    num_blocks: int
    reply: Future[list[jax.Array]]  # the pages, gathered in chunks of BLOCKS_PER_COPY


@dataclass(frozen=True, slots=True)
class _Fetched:
    request_id: str
    block_ids: tuple[int, ...]  # where the pages go
    # (i32[<= M] block ids, their pages: [n, ...page] on the host or [M, ...page] on the
    # device) per copy; None: the fetch failed
    writes: list[tuple[np.ndarray, np.ndarray | jax.Array]] | None


def choose_transport(config: KVTransferConfig, platform: str) -> str:
    """The transport an engine uses: the configured one, else "jax" where the pool's devices
    can move pages device to device (tpu, gpu), "tcp" elsewhere (cpu)."""
    return config.transport or ("jax" if platform in ("tpu", "gpu") else "tcp")


class KVTransferWorker(KVWorker):
    """One engine's side of P/D disaggregation: its connector, transfer server and fetches."""

    def __init__(self, runner: Runner, config: KVTransferConfig, *, block_size: int,
                 page_axis: int, tp_size: int, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        """Compile the page copies for the runner's pool; a producer starts its server.

        Args:
          runner: whose `kv` pool pages are read from and written into.
          config: the engine's `kv_transfer_config`.
          block_size: tokens per block.
          page_axis: the pool's axis of pages (`ModelFns.kv_page_axis`).
          tp_size: tensor-parallel devices the pool is split over.
          clock: seconds, for the producer's abort timeout.
        Raises:
          ValueError: a producer's kv_ip / kv_port cannot be bound.
        """
        self.runner, self.config, self.block_size = runner, config, block_size
        self.clock = clock
        self.copier = BlockCopier(runner.kv, page_axis=page_axis)
        self.layout = KVLayout(page_shape=self.copier.page_shape, dtype=self.copier.dtype.name,
                               block_size=block_size, tp_size=tp_size)
        self.engine_id = config.engine_id or uuid.uuid4().hex
        self.device = next(iter(runner.kv.devices()))
        self.transport = choose_transport(config, self.device.platform)
        self.connector = TransferConnector()
        # Blocks and deadline of each request held for a pickup; written by the engine's
        # thread only (the server's threads test membership, atomic in CPython)
        self._held: dict[str, tuple[tuple[int, ...], float]] = {}
        self._pickups: queue.Queue[_Pickup] = queue.Queue()  # from the server's threads
        self._fetched: queue.Queue[_Fetched] = queue.Queue()  # from the fetch threads
        self._num_fetching = 0  # fetch threads started, their pages not yet written
        self._wake = threading.Event()  # set when a pickup or a fetch arrives
        self._recving: set[str] = set()  # not yet reported (take_output)
        self._sending: set[str] = set()
        self._invalid: set[int] = set()
        self.server: TransferServer | DeviceTransferServer | None = None
        if self.transport == "jax":  # a consumer's server only connects to producers'
            self.server = DeviceTransferServer(
                self.device, config.kv_ip, config.kv_port if config.is_producer else 0)
        elif config.is_producer:
            self.server = TransferServer(config.kv_ip, config.kv_port, self._ask_pickup,
                                         timeout_s=config.abort_timeout_s)

    # ---- requests (the engine's add_request and finish) ----------------------------------

    def check_request(self, kv_transfer_params: Any, num_prompt_tokens: int
                      ) -> RemoteDecode | RemoteHandle | None:
        """What a request's kv_transfer_params ask (`params.parse`), checked; changes nothing.

        Raises:
          ValueError: they cannot be served here (the message names the key).
        """
        return transfer_params.parse(kv_transfer_params, num_prompt_tokens=num_prompt_tokens,
                                     layout=self.layout, transport=self.transport,
                                     producer=self.config.is_producer,
                                     consumer=self.config.is_consumer)

    def add_request(self, request_id: str, asked: RemoteDecode | RemoteHandle | None
                    ) -> None:
        """Register a request that `check_request` accepted (`asked`: what it returned)."""
        if isinstance(asked, RemoteDecode):
            self.connector.remote_decode.add(request_id)
        elif isinstance(asked, RemoteHandle):
            self.connector.remote_prefill[request_id] = asked

    def finish_request(self, request_id: str, *, held_blocks: tuple[int, ...] | None,
                       num_prompt_tokens: int) -> dict[str, Any] | None:
        """Forget a finished or aborted request; the handle its output carries when the
        scheduler holds its blocks (`held_blocks`) for a pickup, else None. The pickup may
        come as soon as the handle is out, so the blocks are servable from now on."""
        self.connector.remote_prefill.pop(request_id, None)
        if request_id not in self.connector.remote_decode:
            return None
        self.connector.remote_decode.discard(request_id)
        if held_blocks is None or self.server is None:
            return None
        transfer_id = None
        if isinstance(self.server, DeviceTransferServer):  # not held: start_step frees them
            transfer_id = uuid.uuid4().int >> 65  # JAX's ids are 64-bit signed
            blocks = held_blocks[:math.ceil(num_prompt_tokens / self.block_size)]
            self.server.offer(transfer_id, self._gather(blocks, to_host=False),
                              timeout_s=self.config.abort_timeout_s)
        else:
            self._held[request_id] = (held_blocks, self.clock() + self.config.abort_timeout_s)
        return transfer_params.handle(engine_id=self.engine_id, host=self.server.host,
                                      port=self.server.port, request_id=request_id,
                                      num_tokens=num_prompt_tokens, layout=self.layout,
                                      transport=self.transport, transfer_id=transfer_id)

    # ---- around a step -------------------------------------------------------------------

    def start_step(self, plan: SchedulerOutput, state: SchedulerState, *, idle: bool) -> None:
        """Carry out a plan's transfers and answer what arrived, before the step is dispatched.

        Args:
          plan: the step's plan (its `kv_connector_metadata`: new holds and loads).
          state: unused: a load's blocks and handle are all it needs.
          idle: the engine has nothing to compute or collect this step; wait up to
            `IDLE_WAIT_S` for a pickup or a fetch if one is pending.
        """
        meta = plan.kv_connector_metadata
        if meta is not None:
            for save in meta.saves:  # each one's pickup was armed by finish_request
                if save.req_id not in self._held:  # (none is not: never leak its blocks)
                    self._sending.add(save.req_id)
            for load in meta.loads:
                self._start_fetch(load)
        if idle and (self._held or self._num_fetching):
            self._wake.wait(IDLE_WAIT_S)
        self._wake.clear()
        self._answer_pickups()
        self._release_expired()
        self._write_fetched()

    def take_output(self) -> KVConnectorOutput | None:
        """The transfers finished since the last call (None: none), for `update_from_output`."""
        if not (self._recving or self._sending or self._invalid):
            return None
        out = KVConnectorOutput(finished_recving=self._recving, finished_sending=self._sending,
                                invalid_block_ids=self._invalid)
        self._recving, self._sending, self._invalid = set(), set(), set()
        return out

    def shutdown(self) -> None:
        """Stop the transfer server (a producer's TCP one)."""
        if isinstance(self.server, TransferServer):
            self.server.close()

    # ---- producer ----------------------------------------------------------------------

    def _ask_pickup(self, request_id: str, first_block: int, num_blocks: int
                    ) -> Future[list[jax.Array]]:
        """(The server's thread.) The pages of a pickup, once the engine's thread has
        gathered them (the server's thread copies them to the host)."""
        reply: Future[list[jax.Array]] = Future()
        if request_id not in self._held:  # answered here: the engine may not be stepping
            reply.set_exception(self._not_held(request_id))
            return reply
        self._pickups.put(_Pickup(request_id, first_block, num_blocks, reply))
        self._wake.set()
        return reply

    def _not_held(self, request_id: str) -> LookupError:
        return LookupError(f"request {request_id!r} holds no KV here: unknown, already picked "
                           f"up, or released after abort_timeout_s="
                           f"{self.config.abort_timeout_s}")

    def _answer_pickups(self) -> None:
        while True:
            try:
                p = self._pickups.get_nowait()
            except queue.Empty:
                return
            held = self._held.pop(p.request_id, None)
            if held is None:
                p.reply.set_exception(self._not_held(p.request_id))
                continue
            self._sending.add(p.request_id)  # one pickup per request, whatever it asks
            blocks = held[0][p.first_block:p.first_block + p.num_blocks]
            if p.first_block < 0 or len(blocks) != p.num_blocks:
                p.reply.set_exception(LookupError(
                    f"request {p.request_id!r} holds {len(held[0])} blocks, asked for "
                    f"{p.num_blocks} from block {p.first_block}"))
                continue
            p.reply.set_result(self._gather(blocks, to_host=True))

    def _gather(self, blocks: tuple[int, ...], *, to_host: bool) -> list[jax.Array]:
        """The pages of `blocks`, [M, ...page] per BLOCKS_PER_COPY of them (padded); with
        `to_host` their copy to the host started (TCP sends them from there)."""
        gather = self.copier.gather if to_host else self.copier.gather_pages
        return [gather(self.runner.kv, np.array(blocks[i:i + BLOCKS_PER_COPY], np.int32))
                for i in range(0, len(blocks), BLOCKS_PER_COPY)]

    def _release_expired(self) -> None:
        now = self.clock()
        for rid in [r for r, (_, deadline) in self._held.items() if deadline <= now]:
            del self._held[rid]
            self._sending.add(rid)
            logger.warning("request %r: no consumer picked its KV up within abort_timeout_s="
                           "%s; its blocks are freed", rid, self.config.abort_timeout_s)

    # ---- consumer ----------------------------------------------------------------------

    def _start_fetch(self, load: KVLoad) -> None:
        handle = self.connector.remote_prefill.pop(load.req_id)
        bs = self.block_size
        first = load.num_computed_tokens // bs
        end = math.ceil((load.num_computed_tokens + load.num_external_tokens) / bs)
        targets = load.block_ids[first:end]
        self._num_fetching += 1
        threading.Thread(target=self._fetch, args=(load.req_id, handle, first, targets),
                         name=f"jaxengine-kv-fetch-{load.req_id}", daemon=True).start()

    def _fetch(self, request_id: str, handle: RemoteHandle, first: int,
               targets: tuple[int, ...]) -> None:
        """(A fetch thread.) The pages of `targets` (pages first .. of the producer's) and
        where they go, or None on failure."""
        writes = None
        try:
            writes = (self._pull(handle, first, targets) if handle.transport == "jax"
                      else self._fetch_tcp(handle, first, targets))
        except (OSError, TransferError, ValueError) as e:
            logger.warning("request %r: fetching its KV from %s:%s failed (%s); its prompt "
                           "is recomputed here", request_id, handle.host, handle.port, e)
        self._fetched.put(_Fetched(request_id, targets, writes))
        self._wake.set()

    def _fetch_tcp(self, handle: RemoteHandle, first: int, targets: tuple[int, ...]
                   ) -> list[tuple[np.ndarray, np.ndarray]]:
        pages = fetch_pages(handle.host, handle.port, handle.request_id,
                            first_block=first, num_blocks=len(targets),
                            page_shape=self.copier.page_shape, dtype=self.copier.dtype,
                            timeout_s=self.config.fetch_timeout_s)
        return [(np.array(targets[i:i + BLOCKS_PER_COPY], np.int32),
                 pages[i:i + BLOCKS_PER_COPY]) for i in range(0, len(targets), BLOCKS_PER_COPY)]

    def _pull(self, handle: RemoteHandle, first: int, targets: tuple[int, ...]
              ) -> list[tuple[np.ndarray, jax.Array]]:
        """All the pages the producer offered (copies of M, from its page 0), pulled onto this
        pool's devices; those before `first` (hit locally) go to the null block."""
        assert isinstance(self.server, DeviceTransferServer) and handle.transfer_id is not None
        num_pages = math.ceil(handle.num_tokens / self.block_size)
        ids = np.zeros(math.ceil(num_pages / BLOCKS_PER_COPY) * BLOCKS_PER_COPY, np.int32)
        ids[first:num_pages] = targets
        pages = self.server.pull(handle.host, handle.port, handle.transfer_id,
                                 [self.copier.pages_struct(self.device)] * (len(ids)
                                                                           // BLOCKS_PER_COPY),
                                 timeout_s=self.config.fetch_timeout_s)
        return [(ids[k * BLOCKS_PER_COPY:(k + 1) * BLOCKS_PER_COPY], p)
                for k, p in enumerate(pages)]

    def _write_fetched(self) -> None:
        while True:
            try:
                f = self._fetched.get_nowait()
            except queue.Empty:
                return
            self._num_fetching -= 1
            self._recving.add(f.request_id)
            if f.writes is None:
                self._invalid.update(f.block_ids)
                continue
            for ids, pages in f.writes:
                scatter = (self.copier.scatter if isinstance(pages, np.ndarray)
                           else self.copier.scatter_pages)
                self.runner.kv = scatter(self.runner.kv, ids, pages)
