"""Streamed responses and their clients, through the real HTTP server: a client that reads
slowly gets its whole stream while other clients load the server, and one that closes its
connection mid-stream is aborted (counted as finished "abort", its KV blocks freed). For each
engine the server drives: a plain `LLMEngine`, a `DataParallelEngine` of two replicas, and the
multi-host `LeaderEngine` (in one process, where its exchange is a no-op); all on the fake model.

A slow reader here holds the server back for real: it reads nothing until the engine has
generated its whole stream (about 385 kB with 20 logprobs a token), about twice what the
server's 4 kB send buffer, the client's receive buffer and the event loop's write buffer hold
together, so the server's stream waits in `send` (uvicorn pauses writing about four times in
each such stream, measured; with the system's send buffer, never) and the outputs wait in the
request's queue. Only a closed connection ends a stream early: uvicorn reports
`http.disconnect` once the socket is closed, however slowly the client reads. (A client must
keep its httpx line iterator while it reads: a dropped one closes the connection, and the
server rightly aborts the request.)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from jaxengine.replicas.data_parallel import DataParallelEngine
from jaxengine.replicas.lockstep import LeaderEngine
from tests.jaxengine.engine.test_llm_engine import PROMPTS, FakeTokenizer, make_engine
from tests.jaxengine.metrics.test_metrics import _value
from tests.jaxengine.server.test_harness import MODEL_NAME, RunningServer, serve_engine

SIZES = dict(num_blocks=600, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64)
ENGINES: dict[str, Callable[[], object]] = {
    "plain": lambda: make_engine(**SIZES),
    "data_parallel": lambda: DataParallelEngine([make_engine(**SIZES), make_engine(**SIZES)]),
    "lockstep": lambda: LeaderEngine(make_engine(**SIZES)),
}
SLOW_MAX_TOKENS = 400
SLOW_LOGPROBS = 20  # about 1 kB a chunk
READ_PAUSE_S = 0.001  # between two chunks of a slow reader
SEND_BUFFER_BYTES = 4096  # the server's kernel send buffer per connection (Linux doubles it)
LOAD_MAX_TOKENS = 30
# Far more than a leaver reads before it leaves: its request is still running when it goes.
LEAVER_MAX_TOKENS = 400
SUCCESS = "jaxengine:request_success_total"


@pytest.fixture(scope="module", params=sorted(ENGINES))
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    running = serve_engine(ENGINES[request.param](), send_buffer_bytes=SEND_BUFFER_BYTES)
    yield running
    running.stop()


def _body(i: int, max_tokens: int, **fields: object) -> dict[str, object]:
    prompt = FakeTokenizer().decode(PROMPTS[i % len(PROMPTS)])
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, **fields}


def _stream(server: RunningServer, body: dict[str, object],
            on_chunk: Callable[[int], bool]) -> tuple[int | None, str | None]:
    """Stream a completion; after the k-th data line (from 1) call `on_chunk(k)`, and close
    the connection when it returns False. Returns (completion_tokens, finish_reason)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    tokens, finish = None, None
    url = f"{server.base_url}/v1/completions"
    with httpx.stream("POST", url, json=body, trust_env=False, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept while reading: a dropped one closes the connection
        for k, line in enumerate((x for x in lines if x.startswith("data: {")), start=1):
            data = json.loads(line.removeprefix("data: "))
            tokens = (data.get("usage") or {}).get("completion_tokens", tokens)
            for choice in data["choices"]:
                finish = choice["finish_reason"] or finish
            if not on_chunk(k):
                break  # leaving the `with` closes the connection mid-stream
    return tokens, finish


def _eventually(done: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Poll `done` until it holds or `timeout_s` passes; its last answer."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
    return done()


def _idle(server: RunningServer) -> bool:
    """No request left in the server or any replica, and every KV block free."""
    replicas = server.engine.replicas
    return (server.async_engine.num_unfinished() == 0
            and not server.engine.has_unfinished_requests()
            and all(r.snapshot().num_free_blocks == r.scheduler_config.num_blocks - 1
                    for r in replicas))


def _finished(server: RunningServer) -> dict[str, float]:
    """request_success_total by finished_reason, summed over replicas."""
    text = httpx.get(f"{server.base_url}/metrics", trust_env=False, timeout=10).text
    return {r: _value(text, SUCCESS, finished_reason=r) for r in ("length", "stop", "abort")}


def _gained(server: RunningServer, before: dict[str, float],
            expected: dict[str, float]) -> dict[str, float]:
    """Counts gained since `before`, once they reach `expected` (bounded wait: the loop counts
    an abort a moment after the engine frees its blocks)."""
    gained: dict[str, float] = {}

    def reached() -> bool:
        gained.update({r: v - before[r] for r, v in _finished(server).items()})
        return gained == expected

    _eventually(reached, timeout_s=10)
    return gained


def _is_live(server: RunningServer, name: str) -> bool:
    """Whether the server still delivers the completion the client named `name` (the engine's
    id is the client's with a random suffix: jaxengine/server/responses.py)."""
    return any(r.startswith(f"cmpl-{name}-") for r in server.async_engine.live_request_ids())


def _read_slowly(server: RunningServer, i: int) -> tuple[int | None, str | None]:
    """A client slower than the engine: it reads its first chunk, then nothing until the
    engine has generated the whole stream (the rest waits in the server and the socket), then
    one chunk at a time with a pause."""
    name = f"slow-{i}-{time.monotonic_ns()}"

    def on_chunk(k: int) -> bool:
        if k == 1:
            assert _eventually(lambda: not _is_live(server, name))
        time.sleep(READ_PAUSE_S)
        return True

    body = _body(i, SLOW_MAX_TOKENS, request_id=name, logprobs=SLOW_LOGPROBS)
    return _stream(server, body, on_chunk)


def _load(server: RunningServer, i: int) -> str:
    """Another client: a stream read at once, a whole response, or a stream left after two
    chunks (a leaver). Returns which."""
    if i % 3 == 0:
        assert _stream(server, _body(i, LOAD_MAX_TOKENS), lambda k: True) == (
            LOAD_MAX_TOKENS, "length")
        return "stream"
    if i % 3 == 1:
        r = httpx.post(f"{server.base_url}/v1/completions", json=_body(i, LOAD_MAX_TOKENS),
                       trust_env=False, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == LOAD_MAX_TOKENS
        return "whole"
    assert _stream(server, _body(i, LEAVER_MAX_TOKENS), lambda k: k < 2)[1] is None
    return "leaver"


def test_a_slow_reader_gets_its_whole_stream_while_others_load_the_server(
        server: RunningServer) -> None:
    assert _eventually(lambda: _idle(server))
    before = _finished(server)
    num_slow, num_load = 2, 12
    with ThreadPoolExecutor(num_slow + num_load) as pool:
        slow = [pool.submit(_read_slowly, server, i) for i in range(num_slow)]
        load = list(pool.map(lambda i: _load(server, i), range(num_load)))
        assert [f.result() for f in slow] == [(SLOW_MAX_TOKENS, "length")] * num_slow
    assert _eventually(lambda: _idle(server))
    # Only the leavers were aborted: every other request ran to its length.
    leavers = load.count("leaver")
    expected = {"length": num_slow + num_load - leavers, "stop": 0, "abort": leavers}
    assert _gained(server, before, expected) == expected


def test_a_client_that_leaves_mid_stream_is_aborted_and_its_blocks_freed(
        server: RunningServer) -> None:
    assert _eventually(lambda: _idle(server))
    before = _finished(server)
    name = f"leaver-{time.monotonic_ns()}"
    seen: list[bool] = []

    def on_chunk(k: int) -> bool:
        seen.append(_is_live(server, name))
        return k < 2

    tokens, finish = _stream(server, _body(1, LEAVER_MAX_TOKENS, request_id=name), on_chunk)
    assert (tokens, finish) == (None, None) and seen == [True, True]  # it left mid-stream
    assert _eventually(lambda: _idle(server))  # aborted, and its KV blocks are free again
    expected = {"length": 0, "stop": 0, "abort": 1}
    assert _gained(server, before, expected) == expected
