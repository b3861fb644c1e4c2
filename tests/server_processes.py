"""Helpers for tests that start `jaxengine serve` as child processes on loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "tiny" / "llama_tied_mha"
# Small engine flags, the same as the CLI tests' (the compilation cache then serves them all).
SMALL = ["--max-num-batched-tokens", "32", "--max-num-seqs", "4", "--block-size", "4",
         "--max-model-len", "128", "--num-gpu-blocks-override", "80"]


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



def start_tiny_serve(port: int, log: Path, *flags: str,
                     env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`jaxengine serve` on the tiny fixture model with `SMALL` and `flags`, on 127.0.0.1:`port`,
    its output in `log`, `env` added to this process's environment; `wait_healthy` on it next."""
    cmd = [sys.executable, "-m", "jaxengine", "serve", str(TINY), "--host", "127.0.0.1",
           "--port", str(port), *SMALL, *flags]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                cwd=ROOT)
