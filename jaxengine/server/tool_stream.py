"""Streaming `tool_choice: "required"`: tool-call deltas from a prefix of the generated array.

With "required" the grammar makes the output vLLM's JSON array of calls, `[{"name": ...,
"parameters": {...}}, ...]` (`jaxengine/server/structured.py`). vLLM streams it by parsing the
partial JSON at every step; here `calls_so_far` scans the text so far (strings, escapes and
nesting; keys in any order) for each call's name, once its string is complete, and the text of
its `parameters` value up to where it has got. `ToolCallStream` turns successive texts into
OpenAI's `delta.tool_calls`: a call opens with its index, id, type and name (and the arguments
so far), then each delta carries the new `arguments` text, so a client that concatenates them
(the official `openai` client does) ends with each call's parameters exactly as generated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from jaxengine.server.structured import tool_call

_WHITESPACE = " \t\n\r"


@dataclass(frozen=True, slots=True)
class CallSoFar:
    """One call of the array, as far as the text has got."""

    name: str | None  # None until its string is complete
    arguments: str  # the `parameters` value's text so far ("" before it starts)


def calls_so_far(text: str) -> list[CallSoFar]:
    """The calls of a prefix of `[{"name": ..., "parameters": ...}, ...]`, the last possibly
    partial; scanning stops at the end of the text or at anything else."""
    i = _skip(text, 0)
    if not text.startswith("[", i):
        return []
    return _calls(text, i + 1)[0]


def _calls(text: str, i: int) -> tuple[list[CallSoFar], int, int]:
    """The calls from `text[i]` on (inside the array), the number of them that closed, and
    where the calls after those start (a later, longer text can be scanned from there)."""
    calls: list[CallSoFar] = []
    resume = i
    while (i := _skip(text, i)) < len(text) and text[i] in ",{":
        if text[i] == ",":
            i += 1
            continue
        i, call, closed = _object(text, i + 1)
        calls.append(call)
        if not closed:
            return calls, len(calls) - 1, resume
        resume = i
    return calls, len(calls), resume


def _object(text: str, i: int) -> tuple[int, CallSoFar, bool]:
    """One call's members from after its "{": (where it ends, the call, whether it closed)."""
    name, arguments = None, ""
    while (i := _skip(text, i)) < len(text):
        if text[i] == "}":
            return i + 1, CallSoFar(name, arguments), True
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            break
        end, done = _string(text, i)
        if not done:
            break
        key = json.loads(text[i:end])
        i = _skip(text, end)
        if not text.startswith(":", i):
            break
        start = _skip(text, i + 1)
        if start >= len(text):
            break
        i, done = _value(text, start)
        if key == "name" and done and text[start] == '"':
            name = json.loads(text[start:i])
        elif key == "parameters":
            arguments = text[start:i]
        if not done:
            break
    return len(text), CallSoFar(name, arguments), False


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def _string(text: str, i: int) -> tuple[int, bool]:
    """The end of the string starting at `text[i]` (a quote), and whether it closed."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1, True
        else:
            j += 1
    return len(text), False


def _value(text: str, i: int) -> tuple[int, bool]:
    """The end of the JSON value starting at `text[i]`, and whether it is complete."""
    if text[i] == '"':
        return _string(text, i)
    if text[i] not in "{[":  # a number or literal: complete once something follows it
        j = i
        while j < len(text) and text[j] not in ",}]" + _WHITESPACE:
            j += 1
        return j, j < len(text)
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == '"':
            j, done = _string(text, j)
            if not done:
                return j, False
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1, True
        j += 1
    return len(text), False


@dataclass(slots=True)
class ToolCallStream:
    """What one choice has streamed of its calls: per opened call, the arguments sent.

    Calls that closed and went out whole are final: each new text is scanned from the end of
    the last of them, so a long array costs its length once, not once per step."""

    sent: list[int] = field(default_factory=list)  # characters of arguments, per call
    _resume: int = 0  # where in the text the calls not final yet start (0: before the "[")
    _num_final: int = 0  # calls before `_resume`

    def deltas(self, text: str) -> list[dict[str, Any]]:
        """The `delta.tool_calls` entries for the whole output `text` so far (none new: [])."""
        if not self._resume:
            i = _skip(text, 0)
            if not text.startswith("[", i):
                return []
            self._resume = i + 1
        calls, num_closed, resume = _calls(text, self._resume)
        first, out = self._num_final, []
        for k, call in enumerate(calls):
            index = first + k
            if index < len(self.sent):
                new = call.arguments[self.sent[index]:]
                if new:
                    out.append({"index": index, "function": {"arguments": new}})
            elif call.name is not None and index == len(self.sent):
                out.append({"index": index, **tool_call(call.name, call.arguments)})
                self.sent.append(0)
            else:
                break
            self.sent[index] = len(call.arguments)
        else:  # every call went out as far as it has got: the closed ones are final
            if num_closed:
                self._num_final, self._resume = first + num_closed, resume
        return out

    @property
    def opened(self) -> bool:
        """True once a call has gone out."""
        return bool(self.sent)
