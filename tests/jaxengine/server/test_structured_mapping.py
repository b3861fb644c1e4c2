"""`jaxengine.server.structured` on its own: request fields to `StructuredOutputsParams`, vLLM's
tool schemas, and generated text back to tool calls (no server)."""

from __future__ import annotations

import json

import pytest

from jaxengine.server.chat_protocol import ChatCompletionRequest
from jaxengine.server.protocol import RequestError
from jaxengine.server.structured import ToolChoice, structured_outputs_of

MESSAGES = [{"role": "user", "content": "x"}]
DEFS = {"unit": {"enum": ["c", "f"]}}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"unit": {"$ref": "#/$defs/unit"}}, "$defs": DEFS}}}
PING = {"type": "function", "function": {"name": "ping"}}


def _of(**fields: object) -> tuple:
    body = ChatCompletionRequest(messages=MESSAGES, **fields)
    return structured_outputs_of(body, body.tool_choice, body.tools)


def test_text_and_none_ask_for_nothing() -> None:
    assert _of() == (None, None)
    assert _of(response_format={"type": "text"}) == (None, None)
    assert _of(tools=[PING], tool_choice="none") == (None, None)


def test_each_field_gives_its_kind() -> None:
    schema = {"type": "object"}
    assert _of(response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": schema}})[0].json == schema
    assert _of(response_format={"type": "json_object"})[0].json_object is True
    assert _of(guided_regex="a+")[0].regex == "a+"
    assert _of(guided_choice=["a", "b"])[0].choice == ("a", "b")
    assert _of(guided_grammar='start: "x"')[0].kind == "grammar"
    so = _of(structured_outputs={"json": schema, "disable_any_whitespace": True})[0]
    assert so.kind == "json" and so.disable_any_whitespace
    assert _of(guided_json=schema, guided_whitespace_pattern=r"[ ]?")[0].whitespace_pattern \
        == r"[ ]?"


def test_a_named_tool_constrains_to_its_parameters() -> None:
    so, choice = _of(tools=[WEATHER, PING],
                     tool_choice={"type": "function", "function": {"name": "weather"}})
    assert choice == ToolChoice("weather") and so.json == WEATHER["function"]["parameters"]
    so, _ = _of(tools=[PING], tool_choice={"type": "function", "function": {"name": "ping"}})
    assert so.json == {"type": "object", "properties": {}}  # no parameters: an empty object


def test_required_uses_vllms_array_schema_with_the_defs_lifted() -> None:
    so, choice = _of(tools=[WEATHER, PING], tool_choice="required")
    assert choice == ToolChoice(None)
    assert so.json == {"type": "array", "minItems": 1, "$defs": DEFS, "items": {
        "type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["weather"]},
                            "parameters": WEATHER["function"]["parameters"]},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["ping"]},
                            "parameters": {"type": "object", "properties": {}}},
             "required": ["name", "parameters"]}]}}


def test_text_back_to_tool_calls() -> None:
    (call,) = ToolChoice("weather").tool_calls('{"unit": "c"}')
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert (call.function.name, call.function.arguments) == ("weather", '{"unit": "c"}')
    calls = ToolChoice(None).tool_calls('[{"name": "ping", "parameters": {}}, '
                                        '{"name": "weather", "parameters": {"unit": "f"}}]')
    assert calls is not None
    assert [c.function.name for c in calls] == ["ping", "weather"]
    assert json.loads(calls[1].function.arguments) == {"unit": "f"}
    assert len({c.id for c in calls}) == 2
    assert ToolChoice(None).tool_calls('[{"name": "ping", "param') is None  # cut short


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [PING], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_regex"),
])
def test_malformed_fields_are_named(fields: dict, param: str) -> None:
    with pytest.raises(RequestError) as e:
        _of(**fields)
    assert e.value.param == param
