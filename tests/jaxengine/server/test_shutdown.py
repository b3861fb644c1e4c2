"""SIGTERM stops `jaxengine serve` with exit status 0: at once when idle; otherwise after the
running requests finish, or `--shutdown-timeout` seconds, when the rest are aborted."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx

from tests.server_processes import free_port, start_tiny_serve, stop, wait_healthy

DRAIN_S = 1.0
SLACK_S = 10.0  # for the process's own exit (JAX's teardown) on a busy machine


def _stream(base: str, max_tokens: int, lines: list[str], started: threading.Event) -> None:
    """A streamed completion's SSE lines into `lines`; `started` is set at the first one."""
    body = {"prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, trust_env=False,
                          timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()
    except httpx.TransportError as e:  # refused: sent after the server stopped listening
        lines.append(repr(e))


def _sigterm(proc: subprocess.Popen[bytes], log: Path) -> tuple[int, float]:
    """SIGTERM `proc`; its exit status and the seconds it took to exit."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        status = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        stop(proc)
        raise AssertionError("serve did not exit after SIGTERM\n" + log.read_text()) from None
    return status, time.monotonic() - t0


def _requests_added(base: str) -> int:
    """Requests the engine has taken so far: running, waiting or finished, from /metrics (on a
    busy machine the first ones may finish before the last are in)."""
    text = httpx.get(f"{base}/metrics", trust_env=False, timeout=10).text
    pattern = (r"^jaxengine:(?:num_requests_(?:running|waiting)|request_success_total)"
               r"\{[^}]*\} (\S+)$")
    return sum(int(float(v)) for v in re.findall(pattern, text, flags=re.M))


def test_sigterm_when_idle_exits_0_at_once(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    proc = start_tiny_serve(port, log)  # the default --shutdown-timeout: 10 s
    wait_healthy(f"http://127.0.0.1:{port}", [proc], log.read_text)
    status, seconds = _sigterm(proc, log)
    assert status == 0, log.read_text()
    assert seconds < SLACK_S, log.read_text()  # nothing to wait for: not the 10 s


def test_sigterm_finishes_a_short_stream_and_aborts_the_rest_after_the_timeout(
        tmp_path: Path) -> None:
    """A 4-token stream ends normally during the drain; 64 streams of 120 tokens (over a second
    of steps at 4 requests a step) are cut short at `DRAIN_S`, each with an error event and
    [DONE], and the log says how many were aborted."""
    port, log = free_port(), tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}"
    proc = start_tiny_serve(port, log, "--shutdown-timeout", str(DRAIN_S))
    wait_healthy(base, [proc], log.read_text)
    short: list[str] = []
    short_started = threading.Event()
    threads = [threading.Thread(target=_stream, args=(base, 4, short, short_started))]
    threads[0].start()
    assert short_started.wait(60)
    long: list[list[str]] = [[] for _ in range(64)]
    for lines in long:
        threads.append(threading.Thread(target=_stream, args=(base, 120, lines,
                                                              threading.Event())))
        threads[-1].start()
    deadline = time.monotonic() + 60
    while _requests_added(base) < 1 + len(long):  # the short one and all the long ones
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    status, seconds = _sigterm(proc, log)
    for t in threads:
        t.join(timeout=30)
    text = log.read_text()
    assert status == 0, text
    assert seconds < DRAIN_S + SLACK_S, text
    assert short[-1] == "data: [DONE]" and "error" not in "".join(short)
    answered = [lines for lines in long if lines and lines[-1] == "data: [DONE]"]
    cut = [lines for lines in answered if '"error"' in lines[-2]]
    assert cut, "no stream was still running at the drain's end"
    error = json.loads(cut[0][-2][len("data: "):])["error"]
    assert (error["message"], error["code"]) == ("the server is shutting down", 503)
    aborted = int(text.split("shutting down: aborting ")[1].split()[0])
    assert aborted >= len(cut), text
