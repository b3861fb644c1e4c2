"""Nothing silently ignored: every request field is honoured, or refused with a 400 naming it."""

from __future__ import annotations

import typing
from typing import Any

import httpx
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from jaxengine.server import refused
from jaxengine.server.chat_protocol import ChatCompletionRequest
from jaxengine.server.protocol import CompletionRequest
from tests.jaxengine.server.test_harness import MODEL_NAME, RunningServer

GOOD = {"completions": {"model": MODEL_NAME, "prompt": "ok", "max_tokens": 2,
                        "ignore_eos": True},
        "chat/completions": {"model": MODEL_NAME, "max_tokens": 2, "ignore_eos": True,
                             "messages": [{"role": "user", "content": "ok"}]}}
TABLE = {"completions": refused.COMPLETION, "chat/completions": refused.CHAT}
# Neutral values a client may send, which ask for nothing and are served.
NEUTRAL: list[tuple[str, str, Any]] = [
    ("completions", "presence_penalty", 0), ("completions", "frequency_penalty", 0.0),
    ("completions", "repetition_penalty", 1.0), ("completions", "logit_bias", {}),
    ("completions", "use_beam_search", False), ("completions", "response_format",
                                                {"type": "text"}),
    ("completions", "store", False), ("completions", "service_tier", "auto"),
    ("completions", "suffix", None), ("completions", "spaces_between_special_tokens", True),
    ("chat/completions", "tool_choice", "none"), ("chat/completions", "modalities", ["text"]),
    ("chat/completions", "include_reasoning", True), ("chat/completions", "bad_words", []),
    ("chat/completions", "prompt_cache_retention", "in_memory"),
]


def _post(server: RunningServer, endpoint: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/{endpoint}", json=body, trust_env=False,
                      timeout=60)


@pytest.mark.parametrize("endpoint", list(GOOD))
@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_field_is_a_400_naming_it(server: RunningServer, endpoint: str,
                                             stream: bool) -> None:
    r = _post(server, endpoint, {**GOOD[endpoint], "stream": stream, "temprature": 0.5})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "temprature"
    assert "unknown field 'temprature'" in error["message"]


def test_unknown_nested_fields_are_named_too(server: RunningServer) -> None:
    chat = {**GOOD["chat/completions"], "messages": [{"role": "user", "content": "x",
                                                      "colour": "red"}]}
    r = _post(server, "chat/completions", chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "'messages.0.colour'" in r.json()["error"]["message"]
    r = _post(server, "completions", {**GOOD["completions"], "stream": True,
                                      "stream_options": {"include_usage": True, "x": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    part = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}
    r = _post(server, "chat/completions", {**GOOD["chat/completions"],
                                           "messages": [{"role": "user", "content": [part]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "'messages.0.content.0.cache_control'" in r.json()["error"]["message"]


def test_a_content_part_that_is_not_text_says_so(server: RunningServer) -> None:
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    r = _post(server, "chat/completions", {**GOOD["chat/completions"],
                                           "messages": [{"role": "user", "content": [image]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "only text content parts" in r.json()["error"]["message"]
    assert "'image_url'" in r.json()["error"]["message"]


REFUSALS = [(endpoint, name) for endpoint, table in TABLE.items() for name in table]


@pytest.mark.parametrize(("endpoint", "name"), REFUSALS, ids=[f"{e}-{n}" for e, n in REFUSALS])
def test_each_known_field_we_cannot_honour_is_a_400_naming_it(server: RunningServer,
                                                              endpoint: str, name: str) -> None:
    table = TABLE[endpoint]
    r = _post(server, endpoint, {**GOOD[endpoint], name: "x"})  # x: no field's neutral value
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == name and f"'{name}' is not supported" in error["message"]
    assert f"({table[name].reason})" in error["message"]  # the reason, not our NamedTuple


@pytest.mark.parametrize(("endpoint", "name", "value"), NEUTRAL,
                         ids=[f"{e}-{n}" for e, n, _ in NEUTRAL])
def test_a_value_that_asks_for_nothing_is_served(server: RunningServer, endpoint: str,
                                                 name: str, value: Any) -> None:
    r = _post(server, endpoint, {**GOOD[endpoint], name: value})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools (honoured with them:
    # test_structured_outputs.py)
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options"),
    ({"metadata": {"k": 5}}, "metadata"),
])
def test_chat_rules(server: RunningServer, body: dict[str, Any], param: str) -> None:
    r = _post(server, "chat/completions", {**GOOD["chat/completions"], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tools_with_tool_choice_none_go_to_the_template(server: RunningServer) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    r = _post(server, "chat/completions", {**GOOD["chat/completions"], "tools": tools,
                                           "tool_choice": "none"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("model", "params"), [
    (CompletionRequest, completion_create_params.CompletionCreateParamsBase),
    (ChatCompletionRequest, chat_create_params.CompletionCreateParamsBase),
])
def test_every_field_of_the_openai_client_is_known(model: type, params: type) -> None:
    # Known means declared: honoured, or refused by name (never an "unknown field" error).
    fields = set(typing.get_type_hints(params)) | {"stream"}
    assert fields - set(model.model_fields) == set()


@pytest.mark.parametrize(("model", "table"), [(CompletionRequest, refused.COMPLETION),
                                              (ChatCompletionRequest, refused.CHAT)])
def test_each_refused_field_is_declared_on_its_model(model: type, table: Any) -> None:
    assert set(table) <= set(model.model_fields)


def test_metadata_and_end_user_ids_go_into_the_requests_metadata() -> None:
    body = CompletionRequest(prompt="x", metadata={"team": "a", "user": "m"}, user="u",
                             safety_identifier="s")
    assert body.metadata_of_request() == {"team": "a", "user": "u", "safety_identifier": "s"}


@pytest.mark.parametrize("endpoint", list(GOOD))
def test_null_means_unset_for_a_field_that_cannot_be_null(server: RunningServer,
                                                          endpoint: str) -> None:
    nulls = {"stream": None, "n": None, "echo": None, "ignore_eos": None, "min_tokens": None,
             "skip_special_tokens": None, "priority": None, "stream_options": None,
             **({"logprobs": None, "add_generation_prompt": None}
                if endpoint.startswith("chat") else {"add_special_tokens": None})}
    r = _post(server, endpoint, {**GOOD[endpoint], **nulls})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None


def test_null_keeps_its_meaning_where_a_field_can_be_null() -> None:
    # completions' max_tokens: 16 when left out, the model's default (or all room) when null
    assert CompletionRequest(prompt="x").max_tokens == 16
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": None}).max_tokens \
        is None
    assert CompletionRequest.model_validate({"prompt": "x", "stream": None}).stream is False
