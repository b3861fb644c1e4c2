"""Structured outputs and tool calls through the real server, with the official `openai` client.

The tiny model's tokens are random; the grammar constrains them, so each output must satisfy
its constraint, checked independently of llguidance (json + jsonschema, Python's `re`). JSON
requests bias the two whitespace tokens of the character-level tokenizer away (" " is 4,
"\\n" is 99; flexible JSON whitespace would otherwise let a random model pad forever), and
small bounded schemas let a value finish within max_tokens. Where a schema admits extra
properties or items (json_object, vLLM's schema for tool_choice "required"), "}" (97) and
"]" (65) are biased up too, so the model closes what it may close instead of going on.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.jaxengine.server.test_harness import MODEL_NAME, RunningServer

NO_SPACE = {"4": -100, "99": -100}
CLOSE_SOON = {**NO_SPACE, "97": 30, "65": 30}
SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"}}, "required": ["n", "ok"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "answer"}]
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["paris", "rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def _chat(client: openai.OpenAI, seed: int, **kw: Any) -> Any:
    kw = {"max_tokens": 60, "logit_bias": NO_SPACE, **kw}
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, seed=seed,
                                          **kw).choices[0]


@pytest.mark.parametrize("seed", range(3))
def test_a_json_schema_response_parses_and_validates(client: openai.OpenAI, seed: int) -> None:
    choice = _chat(client, seed, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_and_guided_json_on_completions(client: openai.OpenAI) -> None:
    choice = _chat(client, 0, response_format={"type": "json_object"}, logit_bias=CLOSE_SOON)
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)
    out = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=60, seed=1,
                                    logit_bias=NO_SPACE, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)


@pytest.mark.parametrize("seed", range(3))
def test_guided_regex_output_fully_matches(client: openai.OpenAI, seed: int) -> None:
    pattern = r"[a-c]{2,4}-[0-9]{3}"
    out = client.completions.create(model=MODEL_NAME, prompt="id:", max_tokens=20, seed=seed,
                                    extra_body={"guided_regex": pattern})
    assert out.choices[0].finish_reason == "stop"
    assert re.fullmatch(pattern, out.choices[0].text), out.choices[0].text


def test_guided_choice_and_structured_outputs_choice(client: openai.OpenAI) -> None:
    choices = ["positive", "negative", "neutral"]
    seen = set()
    for seed in range(4):
        c = _chat(client, seed, extra_body={"guided_choice": choices})
        assert c.message.content in choices and c.finish_reason == "stop"
        seen.add(c.message.content)
        c = _chat(client, seed, extra_body={"structured_outputs": {"choice": choices}})
        assert c.message.content in choices
    out = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=10, n=3, seed=5,
                                    extra_body={"structured_outputs": {"regex": "(yes|no)!"}})
    assert all(c.text in ("yes!", "no!") for c in out.choices)


def test_guided_grammar(client: openai.OpenAI) -> None:
    grammar = 'start: "(" num ("+" num)* ")"\nnum: /[1-9]/'
    out = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=30, seed=2,
                                    extra_body={"guided_grammar": grammar})
    text = out.choices[0].text
    assert re.fullmatch(r"\([1-9](\+[1-9])*\)", text) or (
        out.choices[0].finish_reason == "length" and re.fullmatch(r"\([1-9+]*", text)), text


@pytest.mark.parametrize("seed", range(3))
def test_a_named_tool_call_has_arguments_that_satisfy_its_schema(client: openai.OpenAI,
                                                                 seed: int) -> None:
    choice = _chat(client, seed, tools=[WEATHER, TIME],
                   tool_choice={"type": "function", "function": {"name": "weather"}})
    assert choice.message.content is None and choice.finish_reason == "stop"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("seed", range(3))
def test_required_gives_calls_to_the_tools(client: openai.OpenAI, seed: int) -> None:
    choice = _chat(client, seed, tools=[WEATHER, TIME], tool_choice="required",
                   logit_bias=CLOSE_SOON)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])


def test_a_streamed_named_tool_call(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=60, seed=0, logit_bias=NO_SPACE,
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "weather"}},
        stream=True)
    calls = [d.tool_calls[0] for chunk in stream for d in [chunk.choices[0].delta]
             if d.tool_calls]
    assert calls[0].id and calls[0].function.name == "weather"
    assert all(c.id is None and c.index == 0 for c in calls[1:])
    arguments = "".join(c.function.arguments for c in calls)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("seed", range(3))
def test_streamed_required_tool_calls_accumulate_into_valid_calls(client: openai.OpenAI,
                                                                   seed: int) -> None:
    # The openai client's own accumulation of the deltas (what `.stream()` builds on).
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState()
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=60, seed=seed, logit_bias=CLOSE_SOON,
        tools=[WEATHER, TIME], tool_choice="required", stream=True))
    for chunk in chunks:
        state.handle_chunk(chunk)
    choice = state.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.tool_calls
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    opened = [d for d in deltas if d.id is not None]
    assert [d.index for d in opened] == list(range(len(choice.message.tool_calls)))
    assert all(d.function.name in tools for d in opened)
    whole = _chat(client, seed, tools=[WEATHER, TIME], tool_choice="required",
                  logit_bias=CLOSE_SOON)  # the same seed: the same calls, not streamed
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in whole.message.tool_calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


def _post(server: RunningServer, endpoint: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/{endpoint}", json=body, trust_env=False,
                      timeout=60)


CHAT = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4}
BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format", "not valid"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "structural"),
    ({"guided_json": {"type": "string", "minLength": 3, "maxLength": 1}}, "guided_json",
     "not valid"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"backend": "xgrammar", "regex": "a"}}, "structured_outputs",
     "backend"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "out of scope"),
    ({"tools": [WEATHER]}, "tool_choice", "out of scope"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "time"}}},
     "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice",
     "only one"),
    ({"structural_tag": "x"}, "structural_tag", "not supported"),
]


@pytest.mark.parametrize(("extra", "param", "words"), BAD, ids=[b[1] for b in BAD])
def test_a_bad_constraint_is_a_400_naming_the_field(server: RunningServer, extra: dict,
                                                    param: str, words: str) -> None:
    r = _post(server, "chat/completions", {**CHAT, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
