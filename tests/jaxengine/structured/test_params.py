"""StructuredOutputsParams: exactly one kind, and bad specs refused at request time."""

import pickle

import pytest

from jaxengine.structured import StructuredOutputsError, StructuredOutputsParams
from jaxengine.structured.params import MAX_CHOICE_CHARS, MAX_CHOICES, llguidance_reason
from scheduler import SamplingParamsError


@pytest.mark.parametrize("kwargs, param", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"json": {"type": "object"}, "json_object": True}, "structured_outputs"),
    ({"regex": "a(b"}, "structured_outputs.regex"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"json": {"type": "wat"}}, "structured_outputs.json"),
    ({"json": {"type": "string", "minLength": 5, "maxLength": 2}}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": "[1, 2]"}, "structured_outputs.json"),
    ({"json": 3}, "structured_outputs.json"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": "yes"}, "structured_outputs.choice"),
    ({"choice": ["", "a"]}, "structured_outputs.choice"),
    ({"choice": ["a", 1]}, "structured_outputs.choice"),
    ({"choice": [str(i) for i in range(MAX_CHOICES + 1)]}, "structured_outputs.choice"),
    ({"choice": ["x" * (MAX_CHOICE_CHARS // 2 + 1)] * 2}, "structured_outputs.choice"),
    ({"grammar": "start: foo\nfoo: 'x' bar"}, "structured_outputs.grammar"),
    ({"grammar": "root ::= ("}, "structured_outputs.grammar"),
    ({"json_object": False}, "structured_outputs.json_object"),
    ({"regex": "a", "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern"),
    ({"choice": ["a"], "disable_any_whitespace": True},
     "structured_outputs.disable_any_whitespace"),
    ({"json_object": True, "disable_any_whitespace": True, "whitespace_pattern": " "},
     "structured_outputs.whitespace_pattern"),
    ({"json_object": True, "disable_any_whitespace": 1},
     "structured_outputs.disable_any_whitespace"),
    ({"structural_tag": "{}"}, "structured_outputs.structural_tag"),
])
def test_bad_params_name_the_field(kwargs, param) -> None:
    with pytest.raises(StructuredOutputsError) as info:
        StructuredOutputsParams(**kwargs)
    assert info.value.param == param
    assert isinstance(info.value, SamplingParamsError)  # one error type for the HTTP layer
    assert param in str(info.value)


def test_an_invalid_regex_says_why() -> None:
    with pytest.raises(StructuredOutputsError, match="unclosed group"):
        StructuredOutputsParams(regex="a(b")


def test_the_largest_choice_list_is_accepted() -> None:
    choices = [f"{i:04}" + "x" * (MAX_CHOICE_CHARS // MAX_CHOICES - 4) for i in range(MAX_CHOICES)]
    assert StructuredOutputsParams(choice=choices).kind == "choice"


# What llguidance answers past 65k choices (for 200000 of them, after minutes).
PANIC = """panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10
<backtrace>
   0: <unknown>
  16: type_call
             at /tmp/python-build/Python-3.12.1/Objects/typeobject.c:1661:11
</backtrace>"""


def test_a_panic_of_llguidance_is_logged_not_shown(caplog: pytest.LogCaptureFixture) -> None:
    reason = llguidance_reason(PANIC)
    assert "make it smaller" in reason
    assert not any(word in reason for word in ("panic", "backtrace", "/tmp", ".c:", "u16"))
    assert "grammar.symbols.len()" in caplog.text  # the server's log has it all
    assert llguidance_reason("regex parse error: unclosed group\n") == (
        "regex parse error: unclosed group")


@pytest.mark.parametrize("kwargs, kind", [
    ({"json": {"type": "object"}}, "json"),
    ({"json": '{"type": "integer"}'}, "json"),
    ({"regex": "[0-9]+"}, "regex"),
    ({"choice": ["a", 'quote"d', "back\\slash"]}, "choice"),
    ({"grammar": 'start: "x"'}, "grammar"),
    ({"grammar": 'root ::= "a" | "b"'}, "grammar"),
    ({"json_object": True}, "json_object"),
])
def test_each_kind_is_accepted(kwargs, kind) -> None:
    p = StructuredOutputsParams(**kwargs)
    assert p.kind == kind
    assert p.key[0] == kind and p.llguidance_grammar == p.key[1]


def test_options_change_the_key() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    plain = StructuredOutputsParams(json=schema)
    assert StructuredOutputsParams(json=schema, disable_any_whitespace=True).key != plain.key
    closed = StructuredOutputsParams(json=schema, disable_additional_properties=True)
    assert '"additionalProperties":false' in closed.llguidance_grammar.replace(" ", "")
    assert '"additionalProperties"' not in plain.llguidance_grammar
    assert "additionalProperties" not in schema  # the caller's schema is not changed
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")


def test_params_hash_compare_and_pickle() -> None:
    a = StructuredOutputsParams(json={"type": "object"})
    b = StructuredOutputsParams(json={"type": "object"})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != StructuredOutputsParams(json={"type": "array"})
    back = pickle.loads(pickle.dumps(a))
    assert back == a and back.key == a.key and back.kind == "json"


def test_importable_by_vllms_paths_and_a_dict_is_refused_naming_the_class() -> None:
    import jaxengine
    from jaxengine.sampling_params import SamplingParams
    from jaxengine.sampling_params import StructuredOutputsParams as ByVllmPath

    assert jaxengine.StructuredOutputsParams is ByVllmPath is StructuredOutputsParams
    so = ByVllmPath(choice=["yes", "no"])
    assert SamplingParams(structured_outputs=so).structured_outputs is so
    with pytest.raises(SamplingParamsError, match=r"wrap it: StructuredOutputsParams\(\*\*"
                                                  r"\{'choice': \['yes', 'no'\]\}\)") as e:
        SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    assert e.value.param == "structured_outputs"
