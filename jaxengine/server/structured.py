"""The request fields that constrain the output, as vLLM's OpenAI server maps them.

`response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` object, the legacy
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` extras, and for chat a
`tool_choice` that names a tool or says `"required"` all become one `StructuredOutputsParams`
(jaxengine/structured/params.py) on the request's `SamplingParams`. A request sets at most one
of them; a bad value is a 400 that names the request's field.

Tools (vLLM's `_get_json_schema_from_tool`): a named tool constrains the output to its
`parameters` schema; `"required"` to a JSON array of at least one `{"name", "parameters"}`
object, `anyOf` over the tools. `tool_calls` turns the generated text back into OpenAI's
`message.tool_calls`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jaxengine.server.protocol import RequestError
from jaxengine.server.response_bodies import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from jaxengine.structured.params import StructuredOutputsError, StructuredOutputsParams

# vLLM's StructuredOutputsParams fields a request may set (its other fields are internal).
_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
           "disable_additional_properties", "whitespace_pattern", "structural_tag")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_AUTO = ("tool_choice \"auto\" needs a tool parser made for the model's tool-call format, which "
         "is out of scope for this server; name a tool ({\"type\": \"function\", \"function\": "
         "{\"name\": ...}}), send \"required\", or \"none\"")


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """What a chat request's tools ask of the output: one named tool, or `required`."""

    name: str | None  # the named tool; None: "required" (any of the tools, one or more)

    def tool_calls(self, text: str) -> list[ToolCall] | None:
        """OpenAI's `message.tool_calls` for the generated `text` (vLLM's rule: a named tool's
        arguments are the text itself; "required" parses the JSON array). None when the text
        is not a complete array of calls (e.g. cut by max_tokens)."""
        if self.name is not None:
            return [tool_call(self.name, text)]
        try:
            calls = json.loads(text)
        except ValueError:
            return None
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
            return None
        return [tool_call(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
                for c in calls]


def tool_call_id() -> str:
    """vLLM's id of a tool call (`random_tool_call_id`)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(name: str, arguments: str) -> ToolCall:
    """One OpenAI tool call with a fresh id (an entry of `message.tool_calls`)."""
    return ToolCall(id=tool_call_id(), function=FunctionCall(name=name, arguments=arguments))


def opening_delta(index: int, name: str, arguments: str) -> DeltaToolCall:
    """A stream's first delta of call `index`: a fresh id, the name and the arguments so far
    (vLLM's stream)."""
    return DeltaToolCall(index=index, id=tool_call_id(), type="function",
                         function=DeltaFunctionCall(name=name, arguments=arguments))


def arguments_delta(index: int, arguments: str) -> DeltaToolCall:
    """A later delta of call `index`: its arguments' new text."""
    return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments))


def structured_outputs_of(body: Any, tool_choice: Any = None,
                          tools: Sequence[Mapping[str, Any]] | None = None
                          ) -> tuple[StructuredOutputsParams | None, ToolChoice | None]:
    """The request's output constraint, and its tool choice (chat only).

    Args:
        body: a completions or chat request (its `response_format`, `structured_outputs`,
            `guided_*` and `guided_whitespace_pattern` fields).
        tool_choice, tools: the chat request's.
    Raises:
        RequestError: two fields that constrain the output, a malformed one, or an invalid
            schema, regex, choice list or grammar; `param` names the request's field.
    """
    given: list[tuple[str, dict[str, Any]]] = []
    rf = _response_format(body.response_format)
    if rf is not None:
        given.append(("response_format", rf))
    if body.structured_outputs is not None:
        so = body.structured_outputs
        if not isinstance(so, Mapping):
            raise RequestError(f"structured_outputs must be an object with one of json, regex, "
                               f"choice, grammar, json_object; got {so!r}", "structured_outputs")
        unknown = sorted(set(so) - set(_FIELDS))
        if unknown:
            raise RequestError(f"structured_outputs: unknown field(s) {unknown}; it takes "
                               f"{', '.join(_FIELDS)}", "structured_outputs")
        given.append(("structured_outputs", {k: v for k, v in so.items() if v is not None}))
    for name, kind in _GUIDED.items():
        if getattr(body, name) is not None:
            given.append((name, {kind: getattr(body, name)}))
    choice = _tool_choice(tool_choice, tools)
    if choice is not None:
        given.append(("tool_choice", {"json": _tool_schema(choice, tools or ())}))
    if len(given) > 1:
        raise RequestError(f"only one field may constrain the output; got "
                           f"{', '.join(n for n, _ in given)}", given[1][0])
    pattern = body.guided_whitespace_pattern
    if not given:
        if pattern is not None:
            raise RequestError("guided_whitespace_pattern shapes JSON output: give guided_json "
                               "or a JSON response_format with it", "guided_whitespace_pattern")
        return None, None
    name, fields = given[0]
    if pattern is not None:
        fields = {**fields, "whitespace_pattern": pattern}
    try:
        return StructuredOutputsParams(**fields), choice
    except StructuredOutputsError as e:
        raise RequestError(f"{e} (sent as '{name}')", name) from None


def _response_format(rf: Any) -> dict[str, Any] | None:
    """OpenAI's `response_format` as StructuredOutputsParams fields (None: text)."""
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise RequestError("response_format json_schema needs {\"json_schema\": {\"name\": "
                               "..., \"schema\": {...}}}, with the JSON schema under "
                               "json_schema.schema", "response_format")
        return {"json": dict(schema)}
    raise RequestError(f"response_format type must be \"text\", \"json_object\" or "
                       f"\"json_schema\" (structural tags are not supported); got {rf!r}",
                       "response_format")


def _tool_choice(tool_choice: Any, tools: Sequence[Mapping[str, Any]] | None
                 ) -> ToolChoice | None:
    if tool_choice is None:
        if tools:
            raise RequestError(f"tools without tool_choice means tool_choice \"auto\": "
                               f"{_AUTO}", "tool_choice")
        return None
    if tool_choice == "none":
        return None
    if tool_choice == "auto":
        raise RequestError(_AUTO, "tool_choice")
    if not tools:
        raise RequestError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
    names = [_function(t, i)["name"] for i, t in enumerate(tools)]
    if tool_choice == "required":
        return ToolChoice(None)
    fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not (isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function"
            and isinstance(name, str)):
        raise RequestError(f"tool_choice must be \"none\", \"required\", \"auto\" or "
                           f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}; got "
                           f"{tool_choice!r}", "tool_choice")
    if name not in names:
        raise RequestError(f"tool_choice names tool {name!r}, which is not in tools "
                           f"({names})", "tool_choice")
    return ToolChoice(name)


def _function(tool: Mapping[str, Any], index: int) -> Mapping[str, Any]:
    fn = tool.get("function") if isinstance(tool, Mapping) else None
    if (not isinstance(tool, Mapping) or tool.get("type") != "function"
            or not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str)):
        raise RequestError(f"tools[{index}] must be {{\"type\": \"function\", \"function\": "
                           f"{{\"name\": ..., \"parameters\": {{...}}}}}}; got {tool!r}", "tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, Mapping):
        raise RequestError(f"tools[{index}].function.parameters must be a JSON schema object",
                           "tools")
    return fn


def _parameters(fn: Mapping[str, Any]) -> dict[str, Any]:
    """A function's parameters schema; none (or {}) means an empty object (vLLM)."""
    return dict(fn.get("parameters") or {"type": "object", "properties": {}})


def _tool_schema(choice: ToolChoice, tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """vLLM's `_get_json_schema_from_tool`."""
    fns = [_function(t, i) for i, t in enumerate(tools)]
    if choice.name is not None:
        return _parameters(next(f for f in fns if f["name"] == choice.name))
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {
        "type": "object",
        "anyOf": [{"properties": {"name": {"type": "string", "enum": [f["name"]]},
                                  "parameters": _parameters(f)},
                   "required": ["name", "parameters"]} for f in fns]}}
    defs: dict[str, Any] = {}
    for f in fns:  # vLLM lifts each tool's $defs to the top, where references resolve
        defs.update((f.get("parameters") or {}).get("$defs", {}))
    if defs:
        schema["$defs"] = defs
    return schema
