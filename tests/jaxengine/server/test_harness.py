"""A real server for the server tests: uvicorn in a thread, on a free 127.0.0.1 port.

No tests here; the `test_server_*` modules share one server per test process (`shared_server`)
so the tiny model is loaded and compiled once. Nothing listens beyond the loopback interface.
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import build_engine
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.server import AsyncEngine, build_app

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny" / "llama_tied_mha"
MODEL_NAME = "tiny-llama"
ENGINE_ARGS: dict[str, Any] = dict(
    max_num_batched_tokens=128, max_num_seqs=32, block_size=4, max_model_len=128,
    num_gpu_blocks_override=400)
START_TIMEOUT_S = 300.0  # a bound on failure only; a warm-up under load takes minutes


@dataclass
class RunningServer:
    """A started server and the handles tests need."""

    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread
    port: int

    @property
    def base_url(self) -> str:
        """`http://127.0.0.1:PORT`."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def async_engine(self) -> AsyncEngine:
        """The app's engine loop."""
        return self.app.state.async_engine

    @property
    def engine(self) -> LLMEngine:
        """The engine itself (read its state only: the loop owns it)."""
        return self.async_engine.engine

    def stop(self) -> None:
        """Ask uvicorn to exit and wait (bounded) for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(*, warm_up: bool = False, app_args: dict[str, Any] | None = None,
                 **engine_args: Any) -> RunningServer:
    """Build an engine (on the tiny fixture model unless `model=` says otherwise) and serve it
    on a free loopback port (`warm_up`, `app_args`: as for `serve_engine`)."""
    args = EngineArgs(**{"model": str(TINY), **ENGINE_ARGS, **engine_args})
    return serve_engine(build_engine(args), warm_up=warm_up, **(app_args or {}))


def serve_engine(engine: Any, *, warm_up: bool = False, send_buffer_bytes: int | None = None,
                 **app_args: Any) -> RunningServer:
    """Serve a built engine (an `LLMEngine` or a `DataParallelEngine`) on a free loopback
    port as `MODEL_NAME`; `stop()` it when done.

    `warm_up`: compile every bucket before listening, as `jaxengine serve` does. Off by default
    here: most server tests are not about warm-up, and a step compiles what it needs.
    `send_buffer_bytes`: each connection's kernel send buffer (SO_SNDBUF of the listening
    socket, which accepted sockets inherit); a small one makes a client that does not read
    hold the server's writes back within kilobytes (tests of slow readers). Default: the
    system's, which grows to megabytes.
    `app_args`: `build_app`'s other arguments (e.g. `frontend`).
    """
    app = build_app(engine, model_name=MODEL_NAME, log_interval=0, warm_up=warm_up,
                    **app_args)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name="uvicorn-test-server")
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    return RunningServer(app=app, server=server, thread=thread, port=port)


@functools.cache
def shared_server(config: pytest.Config) -> RunningServer:
    """One server per test session, stopped when pytest unconfigures (not at interpreter exit,
    where uvicorn's shutdown could no longer start its executor's threads)."""
    running = start_server()
    config.add_cleanup(running.stop)
    return running


def wait_until_idle(running: RunningServer, timeout_s: float = 30.0) -> None:
    """Wait (bounded) until the engine has no requests and every KV block is free."""
    engine = running.engine
    usable = engine.scheduler_config.num_blocks - 1
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not engine.has_unfinished_requests() and engine.snapshot().num_free_blocks == usable:
            return
        time.sleep(0.05)
    state = engine.snapshot()
    raise AssertionError(f"engine not idle after {timeout_s}s: {len(state.requests)} requests, "
                         f"{state.num_free_blocks}/{usable} blocks free")
