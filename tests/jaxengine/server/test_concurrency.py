"""Many streaming clients at once: continuous batching, early disconnects, metrics, no leaks."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.jaxengine.server.test_harness import (
    MODEL_NAME,
    RunningServer,
    shared_server,
    wait_until_idle,
)

NUM_CLIENTS = 32
NUM_LEAVERS = NUM_CLIENTS // 4
MAX_TOKENS = 20
LEAVER_MAX_TOKENS = 100  # far more than they read before leaving: they cannot finish first


def _success_total(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", trust_env=False, timeout=10).text
    found = re.findall(r'^jaxengine:request_success_total\{([^}]*)\} (\S+)$', text, re.M)
    return {re.search(r'finished_reason="(\w+)"', labels).group(1): float(v)  # type: ignore
            for labels, v in found}


def _gained(base_url: str, before: dict[str, float], *, aborts: int) -> dict[str, float]:
    """Counts gained since `before`, once `aborts` aborts are in (bounded wait: the loop records
    an abort just after the engine frees its blocks, so an idle engine can be a moment early)."""
    deadline = time.monotonic() + 10
    while True:
        after = _success_total(base_url)
        gained = {k: after[k] - before.get(k, 0.0) for k in after}
        if gained.get("abort", 0.0) >= aborts or time.monotonic() > deadline:
            return gained
        time.sleep(0.02)


def _client(base_url: str, i: int) -> dict[str, object]:
    """One streaming completion; a leaver closes the connection after two chunks."""
    leaver = i < NUM_LEAVERS
    body = {"model": MODEL_NAME, "prompt": f"client {i} says", "stream": True,
            "max_tokens": LEAVER_MAX_TOKENS if leaver else MAX_TOKENS, "temperature": 0.8,
            "seed": i, "ignore_eos": True, "stream_options": {"include_usage": True}}
    chunks, finish, usage, done = 0, None, None, False
    url = f"{base_url}/v1/completions"
    with httpx.stream("POST", url, json=body, trust_env=False, timeout=180) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            done = done or line == "data: [DONE]"
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[len("data: "):])
            usage = data.get("usage") or usage
            for choice in data["choices"]:
                chunks += 1
                finish = choice["finish_reason"] or finish
            if leaver and chunks >= 2:
                break  # leaving the `with` closes the connection mid-stream
    return {"leaver": leaver, "chunks": chunks, "finish": finish, "usage": usage, "done": done}


def test_32_streaming_clients_with_a_quarter_leaving_early(pytestconfig: pytest.Config) -> None:
    server: RunningServer = shared_server(pytestconfig)
    wait_until_idle(server)
    before = _success_total(server.base_url)
    peak_running, sampling = [0], threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + 300
        while not sampling.is_set() and time.monotonic() < deadline:
            peak_running[0] = max(peak_running[0], server.engine.snapshot().stats.num_running)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        results = list(pool.map(lambda i: _client(server.base_url, i), range(NUM_CLIENTS)))
    sampling.set()
    watcher.join(timeout=10)

    stayers = [r for r in results if not r["leaver"]]
    assert len(stayers) == NUM_CLIENTS - NUM_LEAVERS
    for r in stayers:
        assert r["finish"] == "length" and r["done"]
        assert r["usage"]["completion_tokens"] == MAX_TOKENS  # type: ignore[index]
    assert all(r["finish"] is None for r in results if r["leaver"])
    assert peak_running[0] > 1  # clients shared steps: continuous batching across connections

    wait_until_idle(server)  # the leavers were aborted and every KV block is free again
    engine = server.engine
    assert engine.snapshot().num_free_blocks == engine.scheduler_config.num_blocks - 1
    assert server.async_engine.num_unfinished() == 0
    # vLLM's request_success_total counts the leavers too, as finished_reason="abort"
    gained = _gained(server.base_url, before, aborts=NUM_LEAVERS)
    assert gained == {"stop": 0, "length": NUM_CLIENTS - NUM_LEAVERS, "abort": NUM_LEAVERS}


def test_a_non_streaming_client_that_leaves_is_aborted(pytestconfig: pytest.Config) -> None:
    server: RunningServer = shared_server(pytestconfig)
    wait_until_idle(server)
    before = _success_total(server.base_url)
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 120, "ignore_eos": True}
    # The client waits 0.1 s for the answer and the server polls for a disconnect every 50 ms:
    # 120 decode steps (milliseconds each) take longer than that.
    timeout = httpx.Timeout(10.0, read=0.1)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, trust_env=False, timeout=timeout)
    wait_until_idle(server)
    assert _gained(server.base_url, before, aborts=1) == {"stop": 0, "length": 0, "abort": 1}
