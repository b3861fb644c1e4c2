"""The P/D proxy in front of a prefill and a decode server (each a tiny-model engine served in a
thread on 127.0.0.1): answers equal the decode server's own, completions (streamed and not) and
chat, the whole prompt comes from the producer, a client that leaves is aborted, and both end
idle; plus the proxy's choice of instances."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from jaxengine.proxy import CHUNK_CHARS, Instance, PrefixIndex, build_proxy_app, pick
from tests.jaxengine.server.test_harness import RunningServer, start_server, wait_until_idle

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2


def serve_proxy(prefill: list[str], decode: list[str]) -> tuple[str, uvicorn.Server]:
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_proxy_app(prefill, decode),
                                           log_level="warning", lifespan="on"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server


@pytest.fixture(scope="module")
def deployment() -> Iterator[tuple[RunningServer, RunningServer, str]]:
    producer = start_server(kv_transfer_config={"kv_role": "kv_producer", "kv_port": 0})
    consumer = start_server(kv_transfer_config={"kv_role": "kv_consumer"})
    url, proxy = serve_proxy([producer.base_url], [consumer.base_url])
    yield producer, consumer, url
    proxy.should_exit = True
    for s in (producer, consumer):
        s.stop()


@pytest.mark.slow  # two tiny-model servers compiling their buckets: about 15 s on 2 vCPUs
def test_through_the_proxy_the_decode_server_loads_the_prompt_and_answers_as_alone(
        deployment: tuple[RunningServer, RunningServer, str]) -> None:
    producer, consumer, url = deployment
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    with httpx.Client(trust_env=False, timeout=120) as http:
        via = http.post(f"{url}/v1/completions", json=body).json()
        # The whole prompt came from the producer (the consumer then computes its last token
        # again, for the logits), and entered the consumer's prefix cache: the same request
        # sent to it alone finds it there.
        counters = consumer.engine.snapshot().counters
        assert counters.connector_prefix_cache_hits == via["usage"]["prompt_tokens"]
        assert counters.prefix_cache_hits == 0
        alone = http.post(f"{consumer.base_url}/v1/completions", json=body).json()
        assert via["choices"][0]["text"] == alone["choices"][0]["text"]
        assert consumer.engine.snapshot().counters.prefix_cache_hits > 0
        with http.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        assert streamed == alone["choices"][0]["text"]
        chat = {"model": "tiny-llama", "max_tokens": 6, "temperature": 0,
                "messages": [{"role": "user", "content": "Tell me about foxes."}]}
        chat_via = http.post(f"{url}/v1/chat/completions", json=chat).json()
        chat_alone = http.post(f"{consumer.base_url}/v1/chat/completions", json=chat).json()
        assert (chat_via["choices"][0]["message"]["content"]
                == chat_alone["choices"][0]["message"]["content"])
        bad = http.post(f"{url}/v1/completions", json={**body, "temperature": -1})
        assert bad.status_code == 400 and "temperature" in bad.text  # the instance's 400
        # A client that leaves mid-stream: the proxy closes the decode instance's stream,
        # which aborts the request (both servers end idle below).
        with http.stream("POST", f"{url}/v1/completions",
                         json={**body, "max_tokens": 100, "ignore_eos": True, "stream": True,
                               "prompt": "Another prompt"}) as r:
            next(r.iter_lines())
        deadline = time.monotonic() + 30
        while "abort" not in _finished_reasons(http, consumer.base_url):
            assert time.monotonic() < deadline, "the decode instance did not abort"
            time.sleep(0.1)
    for s in (producer, consumer):
        wait_until_idle(s)  # picked up: the producer holds nothing, the consumer is idle


def _finished_reasons(http: httpx.Client, url: str) -> set[str]:
    """The finish reasons a server's /metrics has counted at least once."""
    return {line.split('finished_reason="')[1].split('"')[0]
            for line in http.get(url + "/metrics").text.splitlines()
            if line.startswith("jaxengine:request_success_total{")
            and not line.endswith(" 0.0")}


def test_a_prefill_instance_is_chosen_by_prefix_then_load_and_a_decode_one_by_load() -> None:
    a, b = Instance("http://a"), Instance("http://b")
    prompt = "x" * (3 * CHUNK_CHARS + 5)
    assert pick([a, b], prompt) is a  # nothing known, equal load: the first
    b.prefixes.add(prompt[:2 * CHUNK_CHARS])
    a.in_flight = 0
    b.in_flight = 5
    assert pick([a, b], prompt) is b  # the longer prefix wins over load
    assert pick([a, b]) is a  # by load alone
    index = PrefixIndex(capacity=2)
    index.add(prompt)  # 3 chunks, capacity 2: the oldest is forgotten
    assert index.hit(prompt) == 0 and PrefixIndex().hit(prompt) == 0


def _post_to(app: object, body: object) -> httpx.Response:
    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://proxy") as client:
            return await client.post("/v1/completions", json=body)

    return asyncio.run(post())


def test_an_instance_that_cannot_be_reached_is_a_502_naming_it() -> None:
    app = build_proxy_app(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])  # nothing listens
    answer = _post_to(app, {"prompt": "a"})
    assert answer.status_code == 502
    assert "prefill instance http://127.0.0.1:9 failed" in answer.json()["error"]["message"]


@pytest.mark.parametrize("body", [{"prompt": "a", "n": 2}, {"prompt": ["a", "b"]}, [1, 2]])
def test_the_proxy_refuses_what_it_cannot_hand_on_before_calling_an_instance(
        body: object) -> None:
    app = build_proxy_app(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])  # nothing listens
    answer = _post_to(app, body)
    assert answer.status_code == 400
    assert answer.json()["error"]["message"].startswith(
        "the P/D proxy serves one prompt with n=1" if isinstance(body, dict)
        else "the request body must be a JSON object")
