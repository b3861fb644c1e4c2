"""The server's edge, through a real `jaxengine serve` process: the API key (from the
environment), slow clients, oversized bodies; and `FrontendArgs` itself."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from jaxengine.cli import build_parser
from jaxengine.server.args import API_KEY_ENV, FrontendArgs
from tests.server_processes import free_port, start_tiny_serve, stop, wait_healthy

KEY = "sk-edge-test"
HEADER_TIMEOUT_S = 1.0
BODY_LIMIT = 64 * 1024
COMPLETION = {"prompt": "hi", "max_tokens": 2, "ignore_eos": True}


@dataclass
class Served:
    """A running `jaxengine serve` and where it logs."""

    proc: subprocess.Popen[bytes]
    base: str
    log: Path

    def client(self, api_key: str) -> openai.OpenAI:
        """An official client of it with `api_key`."""
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=api_key, max_retries=0,
                             timeout=60, http_client=httpx.Client(trust_env=False))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One server for the module: its key from $JAXENGINE_API_KEY (no --api-key), a 1 s header
    timeout and a 64 KiB body limit."""
    port, log = free_port(), tmp_path_factory.mktemp("edge") / "serve.log"
    proc = start_tiny_serve(port, log, "--served-model-name", "tiny",
                            "--timeout-headers", str(HEADER_TIMEOUT_S),
                            "--max-request-body-bytes", str(BODY_LIMIT), env={API_KEY_ENV: KEY})
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, [proc], log.read_text)
        yield Served(proc, base, log)
    finally:
        stop(proc)


def _post(served: Served, path: str, key: str | None = KEY, **kw: object) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{served.base}{path}", headers=headers, trust_env=False, timeout=60,
                      **kw)  # type: ignore[arg-type]


def test_the_api_key_from_the_environment_is_required(served: Served) -> None:
    with served.client(KEY) as client:
        out = client.completions.create(model="tiny", prompt="hi", max_tokens=2,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 2
    with served.client("sk-wrong") as client, pytest.raises(openai.AuthenticationError) as e:
        client.models.list()
    assert e.value.status_code == 401
    assert e.value.body == {"message": "invalid API key", "type": "AuthenticationError",
                            "param": None, "code": 401}
    missing = _post(served, "/v1/completions", key=None, json=COMPLETION)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["error"]["message"].startswith("no API key: send the header")
    # Every route needs it but what load balancers and Prometheus poll.
    for path in ("/tokenize", "/detokenize", "/version", "/v1/models", "/openapi.json"):
        r = httpx.request("POST" if path.endswith("tokenize") else "GET", served.base + path,
                          trust_env=False, timeout=60)
        assert r.status_code == 401, path
    assert _post(served, "/tokenize", json={"prompt": "hi"}).status_code == 200
    for path in ("/health", "/ping", "/metrics"):
        assert httpx.get(served.base + path, trust_env=False, timeout=60).status_code == 200
    assert KEY not in served.log.read_text()  # never logged


def _dribble(port: int) -> float:
    """Send a request's headers a byte every 0.2 s; the seconds until the server hangs up."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain":
            try:
                s.sendall(bytes([byte]))
            except OSError:  # reset: the server has closed it
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the server kept a connection whose headers never ended")
    return time.monotonic() - t0


def test_slow_headers_are_cut_off_while_others_are_served(served: Served) -> None:
    port = int(served.base.rsplit(":", 1)[1])
    with ThreadPoolExecutor(5) as pool:
        dribbling = pool.map(lambda _: _dribble(port), range(5))
        assert _post(served, "/v1/completions", json=COMPLETION).status_code == 200
        # Closed after the 1 s deadline; the slack is for a busy machine (and the closing
        # being seen at the next byte sent).
        held = list(dribbling)
        assert all(HEADER_TIMEOUT_S <= t < HEADER_TIMEOUT_S + 5 for t in held), held


def test_an_oversized_body_is_a_413_and_the_server_goes_on(served: Served) -> None:
    big = {**COMPLETION, "prompt": "x" * BODY_LIMIT}
    declared = _post(served, "/v1/completions", json=big)
    assert declared.status_code == 413
    assert declared.json()["error"]["type"] == "RequestEntityTooLargeError"
    assert f"(Content-Length {len(declared.request.content)})" in (
        declared.json()["error"]["message"])

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as the chunks arrive
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    chunked = _post(served, "/v1/completions", content=chunks())
    assert chunked.status_code == 413, chunked.text
    assert chunked.json()["error"]["code"] == 413
    assert _post(served, "/v1/completions", json=COMPLETION).status_code == 200


def test_frontend_args_flags_and_the_environment() -> None:
    ns = build_parser().parse_args(["serve", "--api-key", "k", "--shutdown-timeout", "2.5",
                                    "--timeout-headers", "3", "--max-request-body-bytes", "9"])
    assert (ns.api_key, ns.shutdown_timeout, ns.timeout_headers, ns.max_request_body_bytes) == (
        "k", 2.5, 3.0, 9)
    assert FrontendArgs(api_key="k").with_env_api_key({API_KEY_ENV: "env"}).api_key == "k"
    assert FrontendArgs().with_env_api_key({API_KEY_ENV: "env"}).api_key == "env"
    assert FrontendArgs().with_env_api_key({API_KEY_ENV: ""}).api_key is None
    assert "sk-secret" not in repr(FrontendArgs(api_key="sk-secret"))
    for bad in (dict(api_key=""), dict(api_key=" k"), dict(max_request_body_bytes=0),
                dict(timeout_headers=0), dict(shutdown_timeout=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            FrontendArgs(**bad)  # type: ignore[arg-type]
