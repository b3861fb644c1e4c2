"""`AsyncEngine`: one asyncio task drives `LLMEngine.step()`; HTTP handlers join between steps.

The engine is not thread-safe, so only one party touches it at a time: the loop holds an
`asyncio.Lock` while a step runs (in a worker thread, so the event loop keeps serving), and
`add` takes the same lock between steps. New requests therefore join the running batch at the
next step (continuous batching across clients); `add_all` adds several (a request's n samples,
its list of prompts) under one hold of the lock, as one `RequestGroup`. Aborts never wait: they
are queued and applied by the loop before its next step, so a cancelled handler can abort from a
`finally`.
Metrics are the engine's own step statistics: the Prometheus and log-line loggers join its
`stat_loggers`, each replica's (`EngineClient.replicas`) under its index (`/metrics` has an
`engine` label per replica of a `DataParallelEngine`; the log line sums them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence

from jaxengine.engine.client import EngineClient
from jaxengine.engine.inputs import PromptType
from jaxengine.engine.outputs import RequestOutput
from jaxengine.metrics import (
    LoggingStatLogger,
    PrometheusStatLogger,
    attach_stat_loggers,
    cache_config_info,
)
from scheduler import LoRARequest, SamplingParams, SchedulerStats

logger = logging.getLogger("jaxengine.server")


class EngineDeadError(RuntimeError):
    """The engine could not finish the request: a step raised (its requests were aborted; the
    cause is in the server log and `__cause__`), or the loop stopped. The message is for the
    client; `code` is the HTTP status to answer with (500: the step failed; 503: the server is
    shutting down or not running)."""

    def __init__(self, message: str, *, code: int) -> None:
        super().__init__(message)
        self.code = code


class RequestGroup:
    """The outputs of requests submitted together (n samples, a list of prompts), in step
    order; iterate it, or `abort()` it. Each output names its request (`request_id`)."""

    __slots__ = ("_error", "_live", "_owner", "_ready", "_unread", "request_ids")

    def __init__(self, request_ids: Sequence[str], owner: AsyncEngine) -> None:
        """Outputs of `request_ids` (added to `owner` by `AsyncEngine.add_all`)."""
        self.request_ids = tuple(request_ids)
        self._owner = owner
        # Each request's newest output not read yet. Outputs are cumulative (the whole text and
        # tokens so far), so a newer one replaces it: a reader that lags gets several tokens in
        # one output (as vLLM merges them), and one that stops reading holds one output per
        # request, not one per step, each as long as the text so far.
        self._unread: dict[str, RequestOutput] = {}
        self._error: BaseException | None = None  # the engine failed: raised after the unread
        self._ready = asyncio.Event()  # set when _unread or _error has something
        self._live = set(self.request_ids)  # requests whose final output has not come yet

    @property
    def finished(self) -> bool:
        """True once every request has finished (or the group was aborted or failed)."""
        return not self._live

    def index(self, request_id: str) -> int:
        """The position of `request_id` in the group (the choice's index)."""
        return self.request_ids.index(request_id)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while self._live:
            yield await self._next()

    def _put(self, out: RequestOutput) -> None:
        """The engine's newest output of one of the group's requests (see `_unread`)."""
        self._unread[out.request_id] = out
        self._ready.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def _next(self) -> RequestOutput:
        """The oldest unread output (raises the engine's error once none is left)."""
        while not self._unread and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if not self._unread:
            self._live.clear()
            raise self._error
        out = self._unread.pop(next(iter(self._unread)))
        if out.finished:
            self._live.discard(out.request_id)
        return out

    async def final_all(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None,
                        poll_s: float = 0.05) -> list[RequestOutput] | None:
        """Each request's finished output, in `request_ids` order; None if `is_disconnected()`
        (awaited) turned true first.

        A disconnected client's requests are aborted before returning None. The check (Starlette
        peeks at the ASGI receive channel) is cheap, so it runs every `poll_s` = 50 ms: a leaver
        stops costing decode steps within a few of them.
        """
        loop = asyncio.get_running_loop()
        last: dict[str, RequestOutput] = {}
        next_check = loop.time()  # check at once, then every poll_s
        while self._live:
            # Checked by the clock, not only when idle: a busy stream must notice too.
            if is_disconnected is not None and loop.time() >= next_check:
                if await is_disconnected():
                    self.abort()
                    return None
                next_check = loop.time() + poll_s
            try:
                out = await asyncio.wait_for(self._next(), max(next_check - loop.time(), 0.001))
            except TimeoutError:
                continue
            last[out.request_id] = out
        return [last[r] for r in self.request_ids]

    def abort(self) -> None:
        """Stop the requests still running and free their KV blocks at the next step."""
        for request_id in self._live:
            self._owner.abort(request_id)
        self._live.clear()


class RequestStream(RequestGroup):
    """The outputs of one request, in step order; iterate it, or `abort()` it."""

    __slots__ = ()

    def __init__(self, request_id: str, owner: AsyncEngine) -> None:
        """Outputs of `request_id` (added to `owner` by `AsyncEngine.add`)."""
        super().__init__((request_id,), owner)

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request_ids[0]

    async def final(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None,
                    poll_s: float = 0.05) -> RequestOutput | None:
        """The finished output; None if the client left first (see `final_all`)."""
        outs = await self.final_all(is_disconnected, poll_s)
        return None if outs is None else outs[0]


class AsyncEngine:
    """An engine (an `EngineClient`: an `LLMEngine`, a `DataParallelEngine` or a multi-host
    `LeaderEngine`) behind a background loop, with Prometheus metrics and a log line."""

    def __init__(self, engine: EngineClient, *, model_name: str,
                 log_interval: float = 10.0, metrics: PrometheusStatLogger | None = None
                 ) -> None:
        """Wrap `engine` (start the loop with `start()` inside a running event loop).

        Args:
          engine: the engine; nothing else may call it while the loop runs. Its `stat_loggers`
            (each replica's) gain `metrics` and the log-line logger.
          model_name: the served model name (a metrics label).
          log_interval: seconds between throughput log lines (<= 0: never).
          metrics: where to record; default a new `PrometheusStatLogger` (own registry) with
            an engine index per replica.
        Raises:
          ValueError: `metrics` lacks an engine index of a replica.
        """
        self.engine = engine
        self.model_name = model_name
        self.log_interval = log_interval
        self._replicas = tuple(engine.replicas)
        indexes = range(len(self._replicas))
        self.metrics = metrics or PrometheusStatLogger(model_name, engine.max_model_len,
                                                       engine_indexes=indexes)
        if not set(indexes) <= set(self.metrics.engine_indexes):
            raise ValueError(f"metrics records engines {list(self.metrics.engine_indexes)}, "
                             f"but the engine has {len(indexes)} replicas")
        self.metrics.log_cache_config({i: cache_config_info(r)
                                       for i, r in enumerate(self._replicas)})
        self.stat_logger = LoggingStatLogger(engine_indexes=indexes)
        for i, stats in self._scheduler_stats():
            self.stat_logger.record(stats, engine_idx=i)
        attach_stat_loggers(self._replicas, self.metrics, self.stat_logger)
        self._streams: dict[str, RequestGroup] = {}
        self._pending_aborts: set[str] = set()
        self._lock = asyncio.Lock()
        self._wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Start the step loop (and the periodic log line) on the running event loop."""
        self._tasks.append(asyncio.create_task(self._run(), name="jaxengine-step-loop"))
        if self.log_interval > 0:
            self._tasks.append(asyncio.create_task(self._log_loop(), name="jaxengine-stat-log"))

    def is_running(self) -> bool:
        """True while the step loop task is alive."""
        return bool(self._tasks) and not self._tasks[0].done()

    async def stop(self) -> None:
        """Cancel the loops and abort whatever is still running."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self.engine.abort_request(list(self._streams))
        self._fail_all(EngineDeadError("the server is shutting down", code=503))

    # ---- requests ----------------------------------------------------------------------

    async def add(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                  priority: int = 0, metadata: Mapping[str, str] | None = None,
                  lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue a request; it joins the batch at the next step (`metadata`, `lora_request`:
        see `LLMEngine.add_request`).

        Raises:
          ValueError: the engine rejected the request (bad prompt or parameters).
          EngineDeadError: the loop is not running.
        """
        stream = RequestStream(request_id, self)
        await self._add(stream, [(request_id, prompt, params)], priority, metadata,
                        lora_request)
        return stream

    async def add_all(self, requests: Sequence[tuple[str, PromptType, SamplingParams]], *,
                      priority: int = 0, metadata: Mapping[str, str] | None = None,
                      lora_request: LoRARequest | None = None) -> RequestGroup:
        """Queue several requests (id, prompt, params) at once: all join the same step (n
        samples of one prompt then share its prefix-cache blocks as soon as they are full),
        or none does.

        Raises:
          ValueError: the engine rejected one of them; those already added are aborted.
          EngineDeadError: the loop is not running.
        """
        group = RequestGroup([r[0] for r in requests], self)
        await self._add(group, requests, priority, metadata, lora_request)
        return group

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """`EngineClient.add_lora` between two steps (its errors: `ValueError`)."""
        async with self._lock:
            return self.engine.add_lora(lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """`EngineClient.remove_lora` between two steps."""
        async with self._lock:
            return self.engine.remove_lora(lora_int_id)

    async def list_loras(self) -> set[int]:
        """`EngineClient.list_loras` between two steps."""
        async with self._lock:
            return self.engine.list_loras()

    def live_request_ids(self) -> list[str]:
        """The engine ids of the requests whose outputs the server still delivers."""
        return list(self._streams)

    async def _add(self, group: RequestGroup,
                   requests: Sequence[tuple[str, PromptType, SamplingParams]], priority: int,
                   metadata: Mapping[str, str] | None,
                   lora_request: LoRARequest | None = None) -> None:
        if not self.is_running():
            raise EngineDeadError("the engine loop is not running", code=503)
        async with self._lock:
            added: list[str] = []
            try:
                for request_id, prompt, params in requests:
                    self.engine.add_request(request_id, prompt, params, priority=priority,
                                            metadata=metadata, lora_request=lora_request)
                    added.append(request_id)
            except BaseException:
                self.engine.abort_request(added)
                raise
            for request_id in added:
                self._streams[request_id] = group
            self._wakeup.set()

    def abort(self, request_id: str) -> None:
        """Abort a request at the next step boundary (safe to call from any coroutine)."""
        if self._streams.pop(request_id, None) is not None:
            self._pending_aborts.add(request_id)
            self._wakeup.set()

    def num_unfinished(self) -> int:
        """Requests the server is still streaming."""
        return len(self._streams)

    # ---- the loop ----------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            async with self._lock:
                self._apply_aborts()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.clear()
                    continue
                try:
                    outputs = await asyncio.to_thread(self.engine.step)
                except Exception as e:  # a bug or a device error: fail the batch, keep serving
                    logger.exception("engine step failed; aborting the running requests")
                    self.engine.abort_request(list(self._streams))
                    error = EngineDeadError("the engine failed while running this request, "
                                            "which was aborted; try again", code=500)
                    error.__cause__ = e
                    self._fail_all(error)
                    continue
            self._dispatch(outputs)
            await asyncio.sleep(0)  # let waiting handlers take the lock before the next step

    def _apply_aborts(self) -> None:
        if self._pending_aborts:
            ids, self._pending_aborts = list(self._pending_aborts), set()
            self.engine.abort_request(ids)  # the engine counts them as finished "abort"

    def _dispatch(self, outputs: Sequence[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted while the step ran
            stream._put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_all(self, error: BaseException) -> None:
        for group in set(self._streams.values()):
            group._fail(error)
        self._streams.clear()

    async def _log_loop(self) -> None:
        while True:
            await asyncio.sleep(self.log_interval)
            # The engine records into stat_logger from the step's worker thread: not meanwhile.
            async with self._lock:
                for i, stats in self._scheduler_stats():
                    self.stat_logger.record(stats, engine_idx=i)
                self.stat_logger.log()

    def refresh_gauges(self) -> None:
        """Set the gauges from the current scheduler states (before a /metrics scrape)."""
        for i, stats in self._scheduler_stats():
            self.metrics.record_scheduler(stats, i)

    def _scheduler_stats(self) -> Iterator[tuple[int, SchedulerStats]]:
        """(replica index, its scheduler's statistics now) for each replica."""
        for i, replica in enumerate(self._replicas):
            yield i, replica.snapshot().stats
