"""Bad requests get OpenAI-style 400s, and the server keeps serving after each one."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.jaxengine.test_server_harness import (
    MODEL_NAME,
    RunningServer,
    shared_server,
    wait_until_idle,
)

GOOD_COMPLETION = {"model": MODEL_NAME, "prompt": "ok", "max_tokens": 2, "ignore_eos": True}
GOOD_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "ok"}],
             "max_tokens": 2, "ignore_eos": True}

# (endpoint, body or raw bytes, the param the error should name or None)
BAD: list[tuple[str, Any, str | None]] = [
    ("completions", b'{"model": "tiny-llama", "prompt": "x",', None),
    ("completions", b"not json at all", None),
    ("completions", {**GOOD_COMPLETION, "model": "gpt-4"}, "model"),
    ("completions", {**GOOD_COMPLETION, "max_tokens": "many"}, "max_tokens"),
    ("completions", {**GOOD_COMPLETION, "prompt": 42}, "prompt"),
    ("completions", {**GOOD_COMPLETION, "prompt": ""}, "prompt"),
    ("completions", {**GOOD_COMPLETION, "prompt": []}, "prompt"),
    ("completions", {**GOOD_COMPLETION, "max_tokens": 100_000}, "max_tokens"),
    ("completions", {**GOOD_COMPLETION, "max_tokens": 0}, "max_tokens"),
    ("completions", {**GOOD_COMPLETION, "temperature": -0.5}, "temperature"),
    ("completions", {**GOOD_COMPLETION, "top_p": 0}, "top_p"),
    ("completions", {**GOOD_COMPLETION, "n": 2}, "n"),
    ("completions", {**GOOD_COMPLETION, "logprobs": 1000}, "logprobs"),
    ("completions", {**GOOD_COMPLETION, "prompt": [5, 100_000]}, None),
    ("completions", {"model": MODEL_NAME, "max_tokens": 2}, "prompt"),
    ("completions", [1, 2, 3], None),
    ("chat/completions", {**GOOD_CHAT, "messages": []}, "messages"),
    ("chat/completions", {**GOOD_CHAT, "messages": [{"role": "wizard", "content": "x"}]},
     "messages"),
    ("chat/completions", {**GOOD_CHAT, "messages": "hello"}, "messages"),
    ("chat/completions", {**GOOD_CHAT, "temperature": -1}, "temperature"),
    ("chat/completions", {**GOOD_CHAT, "max_completion_tokens": 10_000}, "max_tokens"),
    ("chat/completions", {**GOOD_CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {**GOOD_CHAT, "model": "nope", "stream": True}, "model"),
]


@pytest.fixture(scope="module")
def server(pytestconfig: pytest.Config) -> RunningServer:
    return shared_server(pytestconfig)


def _post(server: RunningServer, endpoint: str, body: Any) -> httpx.Response:
    url = f"{server.base_url}/v1/{endpoint}"
    if isinstance(body, bytes):
        return httpx.post(url, content=body, headers={"content-type": "application/json"},
                          trust_env=False, timeout=60)
    return httpx.post(url, json=body, trust_env=False, timeout=60)


@pytest.mark.parametrize(("endpoint", "body", "param"), BAD,
                         ids=[f"{e}-{i}" for i, (e, _, _) in enumerate(BAD)])
def test_bad_request_is_a_400_and_the_next_request_works(
        server: RunningServer, endpoint: str, body: Any, param: str | None) -> None:
    r = _post(server, endpoint, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    good = GOOD_CHAT if endpoint.startswith("chat") else GOOD_COMPLETION
    ok = _post(server, endpoint, good)
    assert ok.status_code == 200, ok.text
    wait_until_idle(server)


def test_the_openai_client_raises_bad_request_error(server: RunningServer) -> None:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                       http_client=httpx.Client(trust_env=False)) as client, \
            pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=10**6)
    assert "maximum context length" in str(info.value)


def test_unknown_route_is_an_openai_style_404(server: RunningServer) -> None:
    r = httpx.get(f"{server.base_url}/v1/nothing-here", trust_env=False, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
