"""`jaxengine serve --data-parallel-size 2` in a child process with 2 virtual CPU devices: two
replicas of the tiny checkpoint answer over HTTP, and `/metrics` labels both (about 8 s)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx

from tests.jaxengine.metrics.test_metrics import _value
from tests.parallel_helpers import REPO, device_env
from tests.server_processes import free_port, wait_healthy

TINY = "tests/fixtures/tiny/llama_tied_mha"
START_TIMEOUT_S = 120.0


def test_serve_with_two_replicas(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "jaxengine", "serve", TINY, "--host", "127.0.0.1", "--port",
           str(port), "--data-parallel-size", "2", "--max-model-len", "64", "--block-size", "4",
           "--num-gpu-blocks-override", "64", "--max-num-batched-tokens", "32",
           "--max-num-seqs", "4",
           "--served-model-name", "tiny"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=device_env(2), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, [proc], lambda: log.read_text(errors="replace")[-4000:],
                     timeout=START_TIMEOUT_S)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
        assert reply["usage"]["completion_tokens"] == 4
        text = httpx.get(f"{base}/metrics", timeout=10).text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    assert "engine ready: 2 replica(s)" in log.read_text(errors="replace")
    assert _value(text, "jaxengine:generation_tokens_total", engine="0") == 4
    assert _value(text, "jaxengine:generation_tokens_total", engine="1") == 0
    assert 'jaxengine:num_requests_running{engine="1",model_name="tiny"}' in text
