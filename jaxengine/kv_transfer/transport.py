"""KV pages over TCP: a producer's `TransferServer` and a consumer's `fetch_pages`.

One connection per pickup. The consumer sends one JSON line, `{"request_id": ..., "first_block":
i, "num_blocks": n}`; the producer answers one JSON line, `{"num_pages": n, "page_shape": [...],
"dtype": "..."}` followed by the n pages' bytes ([n, ...page], C order, the pool's dtype), or
`{"error": "..."}`. The pages are those of the producer's pool as they are, so nothing is
converted on either side. A consumer checks the header against its own layout before it reads
the bytes.

The server runs in threads of its own and never touches the engine: it asks for the pages
through `serve_pickup`, which the engine's thread answers between steps (the pool belongs to
the step loop) with the gathered pages; their copy to the host and the sending run here.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

# (request id, first block, number of blocks) -> the pages as arrays of [m, ...page] (device
# arrays, copied to the host here; padded past n), or a `LookupError` whose message goes back
# to the consumer
ServePickup = Callable[[str, int, int], "Future[list[Any]]"]


class TransferError(RuntimeError):
    """A fetch that did not deliver the pages: the producer's answer, or a broken transfer."""


class TransferServer:
    """A TCP server, in a daemon thread, that answers pickups with `serve_pickup`'s pages."""

    def __init__(self, host: str, port: int, serve_pickup: ServePickup, *,
                 timeout_s: float) -> None:
        """Listen on (host, port) (port 0: any free one; `port` says which) and start serving.

        Args:
          serve_pickup: gives a pickup's pages (waits for the engine's thread).
          timeout_s: the most a connection waits for the engine or the consumer.
        Raises:
          ValueError: the address cannot be bound (the message names kv_ip and kv_port).
        """
        handler = _handler(serve_pickup, timeout_s)
        try:
            self._server = socketserver.ThreadingTCPServer((host, port), handler)
        except OSError as e:
            raise ValueError(f"kv_transfer_config: cannot listen on kv_ip={host!r} kv_port="
                             f"{port} ({e}); pick another kv_port (0: any free one)") from e
        self._server.daemon_threads = True
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="jaxengine-kv-transfer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop listening (connections being served finish on their own)."""
        self._server.shutdown()
        self._server.server_close()


def _handler(serve_pickup: ServePickup, timeout_s: float) -> type:
    class Handler(socketserver.StreamRequestHandler):
        timeout = timeout_s

        def handle(self) -> None:
            try:
                ask = json.loads(self.rfile.readline())
                rid, first, n = ask["request_id"], int(ask["first_block"]), int(ask["num_blocks"])
                chunks = serve_pickup(rid, first, n).result(timeout=timeout_s)
            except (LookupError, ValueError, TypeError, TimeoutError) as e:
                self.wfile.write(_line({"error": str(e)}))
                return
            pages = np.concatenate([np.asarray(c) for c in chunks])[:n]
            self.wfile.write(_line({"num_pages": len(pages), "page_shape": pages.shape[1:],
                                    "dtype": pages.dtype.name}))
            self.wfile.write(memoryview(np.ascontiguousarray(pages)).cast("B"))

    return Handler


def fetch_pages(host: str, port: int, request_id: str, *, first_block: int, num_blocks: int,
                page_shape: tuple[int, ...], dtype: np.dtype, timeout_s: float) -> np.ndarray:
    """Fetch pages first_block .. first_block + num_blocks - 1 of a request a producer holds.

    Returns:
      [num_blocks, ...page_shape] in `dtype`.
    Raises:
      TransferError: the producer refused (unknown or expired request, too few blocks), sent
        pages of another layout, or the connection broke; OSError: it could not be reached or
        did not answer in `timeout_s`.
    """
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(_line({"request_id": request_id, "first_block": first_block,
                            "num_blocks": num_blocks}))
        stream = sock.makefile("rb")
        header = json.loads(stream.readline() or b"{}")
        if "error" in header or not header:
            raise TransferError(f"the producer at {host}:{port} refused request "
                                f"{request_id!r}: {header.get('error', 'no answer')}")
        expected = {"num_pages": num_blocks, "page_shape": list(page_shape),
                    "dtype": dtype.name}
        if header != expected:
            raise TransferError(f"the producer at {host}:{port} sent {header}, expected "
                                f"{expected}")
        size = num_blocks * int(np.prod(page_shape)) * dtype.itemsize
        data = stream.read(size)
        if len(data) != size:
            raise TransferError(f"the transfer of request {request_id!r} from {host}:{port} "
                                f"broke after {len(data)} of {size} bytes")
    return np.frombuffer(data, dtype).reshape(num_blocks, *page_shape)


def _line(obj: dict) -> bytes:
    return (json.dumps(obj) + "\n").encode()
