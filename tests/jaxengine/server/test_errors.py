"""Bad requests get OpenAI-style 400s, and the server keeps serving after each one."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import openai
import pytest

from tests.jaxengine.server.test_harness import (
    MODEL_NAME,
    RunningServer,
    wait_until_idle,
)

GOOD_COMPLETION = {"model": MODEL_NAME, "prompt": "ok", "max_tokens": 2, "ignore_eos": True}
GOOD_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "ok"}],
             "max_tokens": 2, "ignore_eos": True}
LONE = "\ud800"  # a lone surrogate: json.dumps sends it as the escape \ud800


def _raw(body: dict[str, Any]) -> bytes:
    """The body as Python's json writes it: lone surrogates escaped, inf and NaN as the
    `Infinity` / `NaN` literals that Python's (and so FastAPI's) JSON parser accepts."""
    return json.dumps(body).encode()

# (endpoint, body or raw bytes, the param the error should name or None)
BAD: list[tuple[str, Any, str | None]] = [
    ("completions", b'{"model": "tiny-llama", "prompt": "x",', None),
    ("completions", b"not json at all", None),
    ("completions", {**GOOD_COMPLETION, "max_tokens": "many"}, "max_tokens"),
    ("completions", {**GOOD_COMPLETION, "prompt": 42}, "prompt"),
    ("completions", {**GOOD_COMPLETION, "prompt": ""}, "prompt"),
    ("completions", {**GOOD_COMPLETION, "prompt": []}, "prompt"),
    ("completions", {**GOOD_COMPLETION, "max_tokens": 100_000}, "max_tokens"),
    ("completions", {**GOOD_COMPLETION, "max_tokens": 0}, "max_tokens"),
    ("completions", {**GOOD_COMPLETION, "temperature": -0.5}, "temperature"),
    ("completions", _raw({**GOOD_COMPLETION, "temperature": math.inf}), "temperature"),
    ("completions", _raw({**GOOD_COMPLETION, "temperature": math.nan}), "temperature"),
    ("completions", _raw({**GOOD_COMPLETION, "top_p": math.nan}), "top_p"),
    ("completions", _raw({**GOOD_COMPLETION, "min_p": math.inf}), "min_p"),
    ("completions", {**GOOD_COMPLETION, "seed": 2**63}, "seed"),
    ("completions", {**GOOD_COMPLETION, "seed": -(2**63) - 1}, "seed"),
    ("completions", _raw({**GOOD_COMPLETION, "prompt": LONE}), "prompt"),
    ("completions", _raw({**GOOD_COMPLETION, "prompt": ["ok" + LONE]}), "prompt"),
    ("completions", _raw({**GOOD_COMPLETION, "model": LONE}), "model"),
    ("completions", _raw({**GOOD_COMPLETION, "stop": [LONE]}), "stop"),
    ("completions", {**GOOD_COMPLETION, "top_p": 0}, "top_p"),
    ("completions", {**GOOD_COMPLETION, "n": 0}, "n"),
    ("completions", {**GOOD_COMPLETION, "n": 2, "best_of": 3}, "best_of"),
    ("completions", {**GOOD_COMPLETION, "logprobs": 1000}, "logprobs"),
    ("completions", {**GOOD_COMPLETION, "logprobs": -1}, "logprobs"),
    ("completions", {**GOOD_COMPLETION, "min_tokens": 5}, "min_tokens"),
    ("completions", {**GOOD_COMPLETION, "stop_token_ids": [3, 100_000]}, "stop_token_ids"),
    ("completions", {**GOOD_COMPLETION, "stop": ["ok", ""]}, "stop"),
    ("completions", {**GOOD_COMPLETION, "top_k": -5}, "top_k"),
    ("completions", {**GOOD_COMPLETION, "prompt": [5, 100_000]}, None),
    # Out of the vocabulary, refused before truncation or echo decode them (found by the fuzz).
    ("completions", {**GOOD_COMPLETION, "prompt": [5, -1, 7], "truncate_prompt_tokens": 2},
     "prompt"),
    ("completions", {**GOOD_COMPLETION, "prompt": [5, 100_000], "echo": True}, "prompt"),
    ("completions", {"model": MODEL_NAME, "max_tokens": 2}, "prompt"),
    ("completions", [1, 2, 3], None),
    ("chat/completions", {**GOOD_CHAT, "messages": []}, "messages"),
    ("chat/completions", {**GOOD_CHAT, "messages": [{"role": "wizard", "content": "x"}]},
     "messages"),
    ("chat/completions", {**GOOD_CHAT, "messages": "hello"}, "messages"),
    ("chat/completions", {**GOOD_CHAT, "temperature": -1}, "temperature"),
    ("chat/completions", {**GOOD_CHAT, "max_completion_tokens": 10_000}, "max_tokens"),
    ("chat/completions", {**GOOD_CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {**GOOD_CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {**GOOD_CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat/completions", _raw({**GOOD_CHAT, "temperature": math.inf}), "temperature"),
    ("chat/completions", _raw({**GOOD_CHAT, "seed": 2**64}), "seed"),
    ("chat/completions", _raw({**GOOD_CHAT, "messages": [{"role": "user", "content": LONE}]}),
     "messages"),
    ("chat/completions", _raw({**GOOD_CHAT, "stream": True, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi " + LONE}]}]}), "messages"),
]


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


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_lone_surrogate_is_named_and_the_connection_stays_up(server: RunningServer,
                                                              endpoint: str) -> None:
    good = GOOD_CHAT if endpoint.startswith("chat") else GOOD_COMPLETION
    bad = ({**good, "messages": [{"role": "user", "content": "a" + LONE}]}
           if endpoint.startswith("chat") else {**good, "prompt": "a" + LONE})
    with httpx.Client(base_url=f"{server.base_url}/v1", trust_env=False, timeout=60) as http:
        r = http.post(endpoint, content=_raw(bad), headers={"content-type": "application/json"})
        assert r.status_code == 400 and "lone UTF-16 surrogate" in r.json()["error"]["message"]
        assert r.headers.get("connection") != "close"
        ok = http.post(endpoint, json=good)  # the same connection: the server kept it open
        assert ok.status_code == 200, ok.text
    wait_until_idle(server)


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_vllms_404(server: RunningServer, stream: bool) -> None:
    for endpoint, good in (("completions", GOOD_COMPLETION), ("chat/completions", GOOD_CHAT)):
        r = _post(server, endpoint, {**good, "model": "gpt-4", "stream": stream})
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("NotFoundError", "model", 404)
        assert "The model `gpt-4` does not exist" in error["message"]
        assert MODEL_NAME in error["message"]  # and says what to send instead
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                       http_client=httpx.Client(trust_env=False)) as client, \
            pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2, stream=stream)
    assert _post(server, "completions", GOOD_COMPLETION).status_code == 200


@pytest.mark.parametrize("top_logprobs", [21, -1])
def test_a_param_named_differently_in_chat_is_named_as_sent(server: RunningServer,
                                                            top_logprobs: int) -> None:
    # SamplingParams calls the count `logprobs`; in chat it is `top_logprobs`.
    r = _post(server, "chat/completions", {**GOOD_CHAT, "logprobs": True,
                                           "top_logprobs": top_logprobs})
    error = r.json()["error"]
    assert (r.status_code, error["param"]) == (400, "top_logprobs")
    assert "(sent as 'top_logprobs')" in error["message"]
    assert str(top_logprobs) in error["message"]


def test_edge_values_vllm_accepts_are_served(server: RunningServer) -> None:
    # vLLM's seed bounds are int64's, negatives included; a top_k beyond the vocabulary is
    # "keep everything" (it once overflowed the i32 metadata and failed the whole step).
    for extra in ({"seed": -(2**63)}, {"seed": 2**63 - 1}, {"seed": -5}, {"top_k": 10**30}):
        r = _post(server, "completions", {**GOOD_COMPLETION, "temperature": 1.0, **extra})
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["usage"]["completion_tokens"] == 2
    wait_until_idle(server)


def test_unknown_route_is_an_openai_style_404(server: RunningServer) -> None:
    r = httpx.get(f"{server.base_url}/v1/nothing-here", trust_env=False, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


@pytest.mark.parametrize(("field", "value"), [
    ("guided_choice", [str(i) for i in range(200_000)]),
    ("structured_outputs", {"choice": ["x" * 60_000, "y" * 60_000]}),
])
def test_an_oversized_choice_list_is_refused_by_its_bounds(server: RunningServer, field: str,
                                                           value: Any) -> None:
    # Unbounded, 200000 choices take llguidance minutes to reach a panic, whose backtrace (with
    # the build's file paths) would be the 400's message.
    r = _post(server, "completions", {**GOOD_COMPLETION, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field
    assert "at most" in error["message"]
    assert not any(word in error["message"].lower() for word in ("backtrace", "panic", ".c:"))


@pytest.mark.parametrize(("endpoint", "body", "param"), [
    ("completions", {**GOOD_COMPLETION, "stream": True, "stream_options": 5}, "stream_options"),
    ("chat/completions", {**GOOD_CHAT, "messages": [5]}, "messages"),
    ("chat/completions", {**GOOD_CHAT, "messages": [{"role": "user", "content": [5]}]},
     "messages"),
])
def test_errors_name_no_class_of_the_server(server: RunningServer, endpoint: str,
                                            body: dict[str, Any], param: str) -> None:
    r = _post(server, endpoint, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    message = r.json()["error"]["message"]
    assert not any(name in message for name in ("StreamOptions", "ChatCompletionMessageParam",
                                                "TextPart", "instance of", "Value error"))
