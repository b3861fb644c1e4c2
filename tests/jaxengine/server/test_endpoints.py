"""vLLM's extra endpoints: /tokenize, /detokenize, /version and /ping, with vLLM's shapes."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import version
from typing import Any

import httpx
import pytest
from pydantic import TypeAdapter

from jaxengine.server.response_bodies import (
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from tests.jaxengine.server.test_harness import MODEL_NAME, RunningServer

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, trust_env=False, timeout=60) as client:
        yield client


def _tokenizer(server: RunningServer) -> Any:
    return server.engine.tokenizer


def test_tokenize_a_prompt(http: httpx.Client, server: RunningServer) -> None:
    tok = _tokenizer(server)
    r = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": "hello world"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens"}
    assert body["tokens"] == tok.encode("hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 128
    bare = http.post("/tokenize", json={"prompt": "<|im_start|>hi", "add_special_tokens": False,
                                        "return_token_strs": True}).json()
    assert bare["tokens"] == tok.encode("<|im_start|>hi", add_special_tokens=False)
    assert bare["token_strs"] == [tok.token_str(t) for t in bare["tokens"]]
    assert bare["token_strs"][0] == "<|im_start|>"


def test_tokenize_a_conversation_gives_the_chat_prompt(http: httpx.Client) -> None:
    r = http.post("/tokenize", json={"messages": MESSAGES})
    assert r.status_code == 200, r.text
    chat = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES,
                                                   "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    without = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})
    assert without.json()["count"] < r.json()["count"]
    text = http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n") and "hi there" in text


def test_detokenize_inverts_tokenize(http: httpx.Client, server: RunningServer) -> None:
    ids = http.post("/tokenize", json={"prompt": "the cat sat"}).json()["tokens"]
    r = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": ids})
    assert r.status_code == 200 and r.json() == {
        "prompt": _tokenizer(server).decode(ids, skip_special_tokens=False)}
    assert "the cat sat" in r.json()["prompt"]


@pytest.mark.parametrize(("path", "body", "param", "code"), [
    ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus", 400),
    ("/tokenize", {"messages": MESSAGES, "bogus": 1}, "bogus", 400),
    ("/tokenize", {"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages", 400),
    ("/tokenize", {"prompt": 5}, "prompt", 400),
    ("/tokenize", {}, "prompt", 400),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model", 404),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True,
                   "add_generation_prompt": True}, "continue_final_message", 400),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens", 400),
    ("/detokenize", {"tokens": "abc"}, "tokens", 400),
    ("/detokenize", {"tokens": [1], "prompt": "x"}, "prompt", 400),
    ("/detokenize", {"tokens": [1], "model": "gpt-4"}, "model", 404),
])
def test_bad_tokenizer_requests_name_the_field(http: httpx.Client, path: str, body: Any,
                                               param: str, code: int) -> None:
    r = http.post(path, json=body)
    assert r.status_code == code, r.text
    assert r.json()["error"]["param"] == param


def test_version_and_ping(http: httpx.Client) -> None:
    assert http.get("/version").json() == {"version": version("jaxengine")}
    assert http.get("/ping").status_code == 200
    assert http.post("/ping").status_code == 200


def test_the_openapi_document_builds_without_a_warning(http: httpx.Client) -> None:
    """Clients and the fuzz test (test_fuzz.py) read /openapi.json; under the suite's
    warnings-as-errors a warning while FastAPI builds it would be a 500."""
    doc = http.get("/openapi.json")
    assert doc.status_code == 200
    assert {"get", "post"} <= set(doc.json()["paths"]["/ping"])


def test_the_openapi_document_describes_the_generation_responses(http: httpx.Client) -> None:
    doc = http.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, name in (("/v1/completions", "CompletionResponse"),
                       ("/v1/chat/completions", "ChatCompletionResponse")):
        ok = doc["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]
        assert ok["schema"]["$ref"] == f"#/components/schemas/{name}"
        assert {"id", "object", "created", "model", "choices", "usage"} <= set(
            schemas[name]["properties"])
    message = schemas["ChatMessage"]["properties"]
    assert set(message) == {"role", "content", "tool_calls"}
    for path, method, name in (("/v1/models", "get", "ModelList"),
                               ("/version", "get", "VersionResponse"),
                               ("/tokenize", "post", "TokenizeResponse"),
                               ("/detokenize", "post", "DetokenizeResponse")):
        ok = doc["paths"][path][method]["responses"]["200"]["content"]["application/json"]
        assert ok["schema"]["$ref"] == f"#/components/schemas/{name}", path


def test_the_other_endpoints_send_their_documented_bodies(http: httpx.Client) -> None:
    """/v1/models, /version, /tokenize, /detokenize and an error parse as their types, and an
    unset optional field is left out, not null."""
    models = TypeAdapter(ModelList).validate_json(http.get("/v1/models").content)
    assert [m.object for m in models.data] == ["model"] and models.data[0].max_model_len > 0
    assert TypeAdapter(VersionResponse).validate_json(http.get("/version").content).version
    r = http.post("/tokenize", json={"prompt": "hello there"})
    assert "token_strs" not in r.json()
    ids = TypeAdapter(TokenizeResponse).validate_json(r.content).tokens
    r = http.post("/tokenize", json={"prompt": "hello there", "return_token_strs": True})
    assert len(r.json()["token_strs"]) == len(ids)
    r = http.post("/detokenize", json={"tokens": ids})
    assert TypeAdapter(DetokenizeResponse).validate_json(r.content).prompt.endswith("there")
    r = http.post("/detokenize", json={"tokens": [-1]})
    error = TypeAdapter(ErrorResponse).validate_json(r.content).error
    assert (r.status_code, error.code, error.param, error.type) == (
        400, 400, "tokens", "BadRequestError")
