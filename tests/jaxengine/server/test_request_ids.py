"""Client request ids (X-Request-Id, `request_id`): echoed back, never shared in the engine."""

from __future__ import annotations

import json
import threading

import httpx

from tests.jaxengine.server.test_harness import MODEL_NAME, RunningServer, wait_until_idle


def test_two_clients_with_the_same_id_both_run_and_get_it_back(server: RunningServer) -> None:
    """Both streams are in the engine at once (100 tokens each, started together); each
    response carries the client's id in its header and in its chunks' id."""
    body = {"model": MODEL_NAME, "prompt": "same", "max_tokens": 100, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = threading.Barrier(2)
    results: list[tuple[int, str, set[str], int]] = []

    def client() -> None:
        start.wait()
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                          headers={"X-Request-Id": "shared"}, trust_env=False,
                          timeout=60) as r:
            lines = [line for line in r.iter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
            results.append((r.status_code, r.headers.get("x-request-id", ""),
                            {c["id"] for c in chunks}, chunks[-1]["usage"]["completion_tokens"]))

    threads = [threading.Thread(target=client) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [(200, "shared", {"cmpl-shared"}, 100)] * 2
    wait_until_idle(server)


def test_the_header_is_echoed_only_when_sent(server: RunningServer) -> None:
    models = f"{server.base_url}/v1/models"
    echoed = httpx.get(models, headers={"X-Request-Id": "abc"}, trust_env=False, timeout=60)
    assert echoed.headers["x-request-id"] == "abc"
    assert "x-request-id" not in httpx.get(models, trust_env=False, timeout=60).headers
    # The body's request_id names the response, not its headers (vLLM's rule too).
    r = httpx.post(f"{server.base_url}/v1/completions", trust_env=False, timeout=60,
                   json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2,
                         "request_id": "in-body"})
    assert r.json()["id"] == "cmpl-in-body" and "x-request-id" not in r.headers
