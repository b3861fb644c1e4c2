"""Helpers for tests that start `jaxengine serve` as child processes on loopback."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, procs: Sequence[subprocess.Popen[bytes]],
                 describe: Callable[[], str], *, timeout: float = 120.0) -> None:
    """Poll `base`/health until it answers 200; fail with `describe()` (the children's logs)
    if a child exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        assert all(p.poll() is None for p in procs), describe()
        try:
            if httpx.get(f"{base}/health", trust_env=False, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up\n" + describe()
        time.sleep(0.25)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a `jaxengine serve` child as Ctrl-C would; kill it if it lingers past 30 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
