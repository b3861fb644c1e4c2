"""The response bodies' JSON (`jaxengine.server.responses`): which fields are absent and
which are null, as vLLM's server sends them and clients read them; and what the server sends
parses back as the type /openapi.json documents."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from pydantic import TypeAdapter

from jaxengine.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxengine.server.response_bodies import (
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionResponse,
    CompletionStreamResponse,
)
from jaxengine.server.responses import ChatFormatter, CompletionFormatter, sse, usage
from jaxengine.server.structured import ToolChoice
from tests.jaxengine.server.test_harness import MODEL_NAME, RunningServer


def _out(text: str, *, finished: bool = False, logprobs: bool = False,
         prompt_logprobs: bool = False) -> RequestOutput:
    ids = tuple(range(len(text.split())))
    entries = [{t: Logprob(-0.5, 1), t + 1: Logprob(float("-inf"), 2)} for t in ids]
    c = CompletionOutput(0, text, ids, None, entries if logprobs else None,
                         "stop" if finished else None, "END" if finished else None)
    plp = [None, {5: Logprob(float("-inf"), 1, "a")}] if prompt_logprobs else None
    return RequestOutput("r", "p", [4, 5], [c], finished, RequestMetrics(0.0),
                         prompt_logprobs=plp)


def _wire(body: object) -> dict[str, Any]:
    line = sse(body)
    assert line.startswith(b"data: ") and line.endswith(b"\n\n")
    return json.loads(line[len(b"data: "):])


def test_a_chat_stream_leaves_out_what_its_chunks_do_not_carry() -> None:
    fmt = ChatFormatter(model="m", tokenizer=None, request_id="chatcmpl-1", created=7)
    (opening,) = map(_wire, fmt.first_chunks(1))
    assert opening == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7,
                       "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                        "content": ""},
                                                  "logprobs": None, "finish_reason": None}]}
    text = _wire(fmt.chunk(0, _out("a b"), with_logprobs=False))
    assert text["choices"] == [{"index": 0, "delta": {"content": "a b"}, "logprobs": None,
                                "finish_reason": None, "stop_reason": None}]
    assert "usage" not in text
    last = _wire(fmt.chunk(0, _out("a b", finished=True), with_logprobs=False))
    assert last["choices"][0]["delta"] == {}
    assert (last["choices"][0]["finish_reason"], last["choices"][0]["stop_reason"]) == (
        "stop", "END")
    assert fmt.chunk(0, _out("a b", finished=False), with_logprobs=False) is None
    final = _wire(fmt.usage_chunk(2, [_out("a b", finished=True)]))
    assert final["choices"] == [] and final["usage"] == {
        "prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_chat_messages_have_tool_calls_only_when_a_tool_answered() -> None:
    plain = ChatFormatter(model="m", tokenizer=None, request_id="chatcmpl-1")
    body = _wire(plain.response([_out("hi", finished=True)], with_logprobs=False,
                                prompt_tokens=2))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert "prompt_logprobs" not in body
    named = ChatFormatter(model="m", tokenizer=None, request_id="chatcmpl-1",
                          tool_choice=ToolChoice("f"))
    message = _wire(named.response([_out('{"x": 1}', finished=True)], with_logprobs=False,
                                   prompt_tokens=2))["choices"][0]["message"]
    assert message["content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "f",
                                                               "arguments": '{"x": 1}'}
    opened = named.chunk(0, _out('{"x"'), with_logprobs=False)
    more = named.chunk(0, _out('{"x": 1}'), with_logprobs=False)
    assert set(_wire(opened)["choices"][0]["delta"]["tool_calls"][0]) == {
        "index", "id", "type", "function"}
    assert _wire(more)["choices"][0]["delta"]["tool_calls"] == [
        {"index": 0, "function": {"arguments": ": 1}"}}]


def test_logprobs_are_finite_and_prompt_logprobs_keyed_by_token_id() -> None:
    fmt = CompletionFormatter(model="m", tokenizer=None, request_id="cmpl-1",
                              prompt_logprobs=True)
    out = _out("a", finished=True, logprobs=True, prompt_logprobs=True)
    (choice,) = _wire(fmt.response([out], with_logprobs=True, prompt_tokens=2))["choices"]
    assert choice["logprobs"] == {"tokens": ["token_id:0"], "token_logprobs": [-0.5],
                                  "top_logprobs": [{"token_id:0": -0.5,
                                                    "token_id:1": -9999.0}],
                                  "text_offset": [0]}
    assert choice["prompt_logprobs"] == [None, {"5": {"logprob": -9999.0, "rank": 1,
                                                      "decoded_token": "a"}}]
    chat = ChatFormatter(model="m", tokenizer=None, request_id="chatcmpl-1", top_logprobs=1,
                         prompt_logprobs=True)
    body = _wire(chat.response([out], with_logprobs=True, prompt_tokens=2))
    assert body["prompt_logprobs"][1]["5"]["logprob"] == -9999.0
    assert body["choices"][0]["logprobs"] == {"content": [
        {"token": "token_id:0", "logprob": -0.5, "bytes": list(b"token_id:0"),
         "top_logprobs": [{"token": "token_id:0", "logprob": -0.5,
                           "bytes": list(b"token_id:0")}]}]}


def test_completion_chunks_carry_usage_only_when_given() -> None:
    fmt = CompletionFormatter(model="m", tokenizer=None, request_id="cmpl-1")
    assert fmt.first_chunks(1) == []
    plain = _wire(fmt.chunk(0, _out("a"), with_logprobs=False))
    assert "usage" not in plain and plain["object"] == "text_completion"
    counted = _wire(fmt.chunk(0, _out("a b", finished=True), with_logprobs=False,
                              usage_so_far=usage(2, [_out("a b")])))
    assert counted["usage"]["completion_tokens"] == 2
    assert counted["choices"][0]["text"] == " b"


@pytest.mark.parametrize(("path", "body", "whole", "chunk"), [
    ("/v1/completions", {"prompt": ["hello", "the cat"], "n": 2, "echo": True, "logprobs": 2,
                         "prompt_logprobs": 1}, CompletionResponse, CompletionStreamResponse),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2,
                              "logprobs": True, "top_logprobs": 2},
     ChatCompletionResponse, ChatCompletionStreamResponse),
])
def test_what_the_server_sends_parses_as_its_documented_type(
        server: RunningServer, path: str, body: dict[str, Any], whole: type,
        chunk: type) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 4, **body}
    with httpx.Client(base_url=server.base_url, trust_env=False, timeout=60) as http:
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        parsed = TypeAdapter(whole).validate_json(r.content)
        assert len(parsed.choices) == (4 if path == "/v1/completions" else 2)
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        stream.pop("prompt_logprobs", None)  # not with stream (vLLM's rule)
        with http.stream("POST", path, json=stream) as events:
            lines = [line.removeprefix("data: ") for line in events.iter_lines()
                     if line.startswith("data: {")]
    chunks = [TypeAdapter(chunk).validate_json(line) for line in lines]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
