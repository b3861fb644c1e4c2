"""uvicorn as `jaxengine serve` runs it: bounded against slow clients, and stopped by SIGTERM as
by Ctrl-C, with exit status 0 after a bounded drain.

Slow clients: uvicorn bounds an idle connection between requests (`timeout_keep_alive`) and
the size of a request's headers (h11's 16 KiB), but not the time its headers take: a client
sending a byte every few seconds holds its connection as long as it likes (no timer runs on a
new connection, and the keep-alive one stops at the next request's first byte).
`HeaderTimeoutProtocol` closes such a connection `timeout_headers` seconds after it opened, or
after its previous response. Why not `limit_concurrency`: it answers 503 to everyone once slow
clients hold the connections, where the timeout frees them.

Shutdown: on SIGTERM or SIGINT uvicorn stops listening and waits for the running requests to
end. `shutdown_timeout` seconds in, `DrainingServer` stops the engine, which ends the requests
still running (their streams with an error event and [DONE], so each response ends cleanly and
its connection closes); uvicorn's own `timeout_graceful_shutdown`, `CANCEL_AFTER_S` later,
cancels what even that did not end (a request whose body is still arriving). At the end uvicorn
raises the signal again with the handler it found: for SIGTERM the default one, which kills the
process (status 143) after a clean shutdown. Here SIGTERM is made a KeyboardInterrupt, as
SIGINT is, and caught, so a process told to stop exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxengine.server.args import FrontendArgs

logger = logging.getLogger("jaxengine.server")

# Seconds after the drain deadline at which uvicorn cancels the requests the engine's stop did
# not end: those still reading a request body, which no engine request backs yet.
CANCEL_AFTER_S = 5.0


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's headers.

    The deadline runs from the connection's start, and from the end of each response (the
    next request's turn); it is cancelled once h11 has the request's headers (its client state
    leaves IDLE). Always h11, even where httptools is installed: the timeout lives here.
    """

    def __init__(self, *args: Any, timeout_headers: float, **kwargs: Any) -> None:
        """uvicorn's arguments, and the seconds a request's headers may take."""
        super().__init__(*args, **kwargs)
        self.timeout_headers = timeout_headers
        self._headers_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start the first request's deadline."""
        super().connection_made(transport)
        self._start_deadline()

    def data_received(self, data: bytes) -> None:
        """Feed h11; once the request's headers are in, its deadline is met."""
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._cancel_deadline()

    def on_response_complete(self) -> None:
        """Start the next request's deadline, unless a pipelined one is already in."""
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._start_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        """Drop the deadline with the connection."""
        self._cancel_deadline()
        super().connection_lost(exc)

    def _start_deadline(self) -> None:
        self._cancel_deadline()
        self._headers_deadline = self.loop.call_later(self.timeout_headers, self._on_deadline)

    def _cancel_deadline(self) -> None:
        if self._headers_deadline is not None:
            self._headers_deadline.cancel()
            self._headers_deadline = None

    def _on_deadline(self) -> None:
        # No response: h11 has no request to answer yet (nginx would send a 408; a client
        # this slow is not waiting for one).
        self._headers_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which ends what still runs `drain_s` seconds into a shutdown by
    awaiting `stop_requests()`."""

    def __init__(self, config: uvicorn.Config, *, drain_s: float,
                 stop_requests: Callable[[], Awaitable[None]]) -> None:
        """Serve `config`; `stop_requests` ends the running requests (the engine's stop)."""
        super().__init__(config)
        self.drain_s = drain_s
        self.stop_requests = stop_requests

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, with the drain deadline running alongside."""
        logger.info("shutting down: running requests have %g s to finish (--shutdown-timeout)",
                    self.drain_s)
        deadline = asyncio.create_task(self._stop_after_drain(), name="jaxengine-drain")
        try:
            await super().shutdown(sockets=sockets)
        finally:
            deadline.cancel()

    async def _stop_after_drain(self) -> None:
        await asyncio.sleep(self.drain_s)
        await self.stop_requests()


def run_uvicorn(app: FastAPI, *, host: str, port: int, log_level: str, frontend: FrontendArgs,
                stop_requests: Callable[[], Awaitable[None]]) -> None:
    """Serve `app` on `host`:`port` with `frontend`'s timeouts until SIGTERM or SIGINT; return
    once uvicorn has shut down (blocks). `stop_requests` ends the requests a shutdown's drain
    (`frontend.shutdown_timeout`) leaves running."""

    def protocol(*args: Any, **kwargs: Any) -> HeaderTimeoutProtocol:
        return HeaderTimeoutProtocol(*args, timeout_headers=frontend.timeout_headers, **kwargs)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                            timeout_keep_alive=frontend.timeout_keep_alive,
                            timeout_graceful_shutdown=frontend.shutdown_timeout + CANCEL_AFTER_S)
    server = DrainingServer(config, drain_s=frontend.shutdown_timeout,
                            stop_requests=stop_requests)
    if threading.current_thread() is threading.main_thread():  # only it may set handlers
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    with contextlib.suppress(KeyboardInterrupt):  # the signal uvicorn raises again at the end
        server.run()
