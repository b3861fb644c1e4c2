"""`tool_choice: "required"` streaming on its own: every prefix of a generated call array fed
in turn gives deltas that a client concatenating them (as the `openai` client does) turns
into exactly the calls of the whole text, whatever the whitespace, key order, escapes or
braces inside strings; nothing opens before its name is complete."""

from __future__ import annotations

import json

import pytest

from jaxengine.server.response_bodies import DeltaToolCall, to_json
from jaxengine.server.tool_stream import ToolCallStream, calls_so_far

TEXTS = [
    '[{"name": "weather", "parameters": {"city": "paris", "days": 3}}]',
    '[{"name":"a","parameters":{}},{"name":"b","parameters":{"x":[1,{"y":"}]"}],"z":-2.5}}]',
    ' [\n {\n  "parameters" : {"q": "say \\"hi\\" {"},\n  "name": "quo\\"te"\n }\n]\n',
    '[{"name": "n", "parameters": {"deep": {"deeper": [[], [true, null, 12]]}}}, '
    '{"name": "m", "parameters": {"s": "\\\\"}}]',
]


def _wire(delta: DeltaToolCall) -> dict:
    """The delta as the client gets it."""
    return json.loads(to_json(delta))


def _accumulate(text: str) -> list[dict]:
    stream, calls = ToolCallStream(), []
    for end in range(len(text) + 1):
        for d in map(_wire, stream.deltas(text[:end])):
            if "id" in d:
                assert d["index"] == len(calls) and d["type"] == "function"
                assert d["function"]["name"] is not None
                calls.append({"id": d["id"], "name": d["function"]["name"],
                              "arguments": d["function"]["arguments"]})
            else:
                assert set(d) == {"index", "function"} and d["function"]["arguments"]
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return calls


@pytest.mark.parametrize("text", TEXTS)
def test_every_prefix_adds_up_to_the_whole_calls(text: str) -> None:
    expected = [(c["name"], c["parameters"]) for c in json.loads(text)]
    calls = _accumulate(text)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == expected
    assert len({c["id"] for c in calls}) == len(calls)


def test_a_call_opens_only_once_its_name_is_complete() -> None:
    (partial,) = calls_so_far('[{"name": "wea')
    assert partial.name is None and partial.arguments == ""
    stream = ToolCallStream()
    assert stream.deltas('[{"name": "wea') == [] and not stream.opened
    (opened,) = map(_wire, stream.deltas('[{"name": "weather", "parameters": {"ci'))
    assert opened["function"] == {"name": "weather", "arguments": '{"ci'}
    assert stream.deltas('[{"name": "weather", "parameters": {"ci') == []
    (more,) = map(_wire, stream.deltas('[{"name": "weather", "parameters": {"city": 1}} '))
    assert more == {"index": 0, "function": {"arguments": 'ty": 1}'}}


@pytest.mark.parametrize("text", ["", "   ", "{}", "hello", "[", "[ "])
def test_no_calls_before_an_array_of_objects(text: str) -> None:
    assert ToolCallStream().deltas(text) == []


def test_calls_already_sent_whole_are_not_scanned_again(monkeypatch: pytest.MonkeyPatch) -> None:
    from jaxengine.server import tool_stream

    scanned = []
    real = tool_stream._object

    def counting(text: str, i: int):  # type: ignore[no-untyped-def]
        scanned.append(i)
        return real(text, i)

    monkeypatch.setattr(tool_stream, "_object", counting)
    text = "[" + ", ".join(f'{{"name": "f{i}", "parameters": {{"i": {i}}}}}' for i in range(40))
    text += "]"
    stream, steps = ToolCallStream(), range(0, len(text) + 1, 7)
    opened = sum("id" in _wire(d) for end in steps for d in stream.deltas(text[:end]))
    assert opened == 40
    # at most the call that just closed and the one after it, per text: not all 40 each time
    assert len(scanned) <= 2 * len(steps)


def test_scanning_stops_at_text_that_is_not_json() -> None:
    (closed,) = calls_so_far('[{"name": "a", "parameters": {}} x {"name": "b"')
    assert (closed.name, closed.arguments) == ("a", "{}")
    # a call that is not JSON even as a prefix never opens (partial_json_parser refuses it)
    assert calls_so_far('[{"name": "a", "parameters": {} x') == []
