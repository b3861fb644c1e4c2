"""Streaming `tool_choice: "required"`: tool-call deltas from a prefix of the generated array.

With "required" the grammar makes the output vLLM's JSON array of calls, `[{"name": ...,
"parameters": {...}}, ...]` (`jaxengine/server/structured.py`). vLLM streams it by parsing the
partial JSON at every step with `partial_json_parser`, and so does `calls_so_far` here (keys in
any order): each call's name, once its string is complete, and the text of its `parameters`
value up to where it has got. `ToolCallStream` turns successive texts into
OpenAI's `delta.tool_calls`: a call opens with its index, id, type and name (and the arguments
so far), then each delta carries the new `arguments` text, so a client that concatenates them
(the official `openai` client does) ends with each call's parameters exactly as generated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from partial_json_parser import Allow, loads

from jaxengine.server.response_bodies import DeltaToolCall
from jaxengine.server.structured import arguments_delta, opening_delta

_WHITESPACE = " \t\n\r"
_DECODER = json.JSONDecoder()
_PARTIAL_WITHOUT_STR = Allow.ALL & ~Allow.STR  # vLLM's flags until a call's name is sent


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
        if (one := _object(text, i + 1)) is None:
            break
        i, call, closed = one
        calls.append(call)
        if not closed:
            return calls, len(calls) - 1, resume
        resume = i
    return calls, len(calls), resume


def _object(text: str, i: int) -> tuple[int, CallSoFar, bool] | None:
    """One call from after its "{": (where it ends, the call, whether it closed); None when
    the text there is not JSON (scanning stops).

    A closed call is json's to decode (which also says where it ends); the one still being
    generated is partial_json_parser's, as in vLLM's tool parsers, with partial strings left
    out so that a name counts only once its string is complete."""
    try:
        call, end = _DECODER.raw_decode(text, i - 1)
        closed = True
    except ValueError:
        try:  # its fast fix assumes valid partial JSON (it asserts); the full one checks it
            call = loads(text[i - 1:], _PARTIAL_WITHOUT_STR, use_fast_fix=False)
        except ValueError:  # partial_json_parser's MalformedJSON
            return None
        end = len(text)
        closed = False
    if not isinstance(call, dict):
        return None
    name = call.get("name")
    return end, CallSoFar(name if isinstance(name, str) else None, _arguments(text, i)), closed


def _arguments(text: str, i: int) -> str:
    """The text of the `parameters` value of the call whose members start at `text[i]`, as
    far as it has got ("" before it starts).

    The one piece of scanning kept by hand (a walk over the members, values skipped by json):
    json and partial_json_parser give values, not where they lie in the text, and the stream
    must send the arguments exactly as generated, so that the deltas a client concatenates
    are the generated text, not a re-serialization of it (vLLM's json.dumps and prefix diffs)."""
    while (i := _skip(text, i)) < len(text) and text[i] != "}":
        if text[i] == ",":
            i += 1
            continue
        try:
            key, i = _DECODER.raw_decode(text, i)
        except ValueError:  # a key still being generated
            return ""
        i = _skip(text, i)
        if not isinstance(key, str) or not text.startswith(":", i):
            return ""
        start = _skip(text, i + 1)
        try:
            i = _DECODER.raw_decode(text, start)[1]
        except ValueError:  # the value is still being generated: it runs to the end
            i = len(text)
        if key == "parameters":
            return text[start:i]
    return ""


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


@dataclass(slots=True)
class ToolCallStream:
    """What one choice has streamed of its calls: per opened call, the arguments sent.

    Calls that closed and went out whole are final: each new text is scanned from the end of
    the last of them, so a long array costs its length once, not once per step."""

    sent: list[int] = field(default_factory=list)  # characters of arguments, per call
    _resume: int = 0  # where in the text the calls not final yet start (0: before the "[")
    _num_final: int = 0  # calls before `_resume`

    def deltas(self, text: str) -> list[DeltaToolCall]:
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
                    out.append(arguments_delta(index, new))
            elif call.name is not None and index == len(self.sent):
                out.append(opening_delta(index, call.name, call.arguments))
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
