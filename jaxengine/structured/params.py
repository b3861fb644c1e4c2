"""`StructuredOutputsParams`: what a request's output must match, validated when built.

vLLM's request-side shape (`vllm.sampling_params.StructuredOutputsParams`), with its field names:
exactly one kind among `json`, `regex`, `choice`, `grammar`, `json_object`, plus the options that
shape JSON grammars. Building one turns the spec into an llguidance grammar and checks it without
a tokenizer (vLLM's `validate_guidance_grammar`), so an invalid JSON schema, regex or grammar is
reported when the request arrives, not when it is compiled. Compiling against the tokenizer is
`GrammarCompiler`'s job (jaxengine/structured/compiler.py).
"""

import copy
import json as jsonlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance

from scheduler.sampling_params import SamplingParamsError

KINDS = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's order
# A choice list's bounds: OpenAI's on a structured-outputs schema's enum values (1000), and a
# total length that compiles in well under a second. llguidance itself asserts (a panic) past
# about 65k choices, and takes seconds long before that.
MAX_CHOICES = 1000
MAX_CHOICE_CHARS = 100_000
_JSON_KINDS = ("json", "json_object")
_JSON_OPTIONS = ("disable_additional_properties", "whitespace_pattern")


logger = logging.getLogger("jaxengine.structured")


class StructuredOutputsError(SamplingParamsError):
    """A structured-outputs field that cannot be used; `param` is e.g. `"structured_outputs.regex"`
    and the message says what to change."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StructuredOutputsParams:
    """One output constraint, as vLLM's `StructuredOutputsParams`.

    Give exactly one of `json`, `regex`, `choice`, `grammar`, `json_object`.

    Attributes:
        json: a JSON schema, as a mapping or its JSON text.
        regex: a regular expression the whole output matches (Rust `regex` syntax).
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar, in Lark or GBNF (llama.cpp) syntax.
        json_object: True: any JSON object (OpenAI's `response_format: json_object`).
        disable_any_whitespace: JSON kinds: no whitespace between tokens of the JSON text.
        disable_additional_properties: `json`: objects with `properties` get
            `additionalProperties: false` unless the schema says otherwise (as vLLM).
        whitespace_pattern: JSON kinds: the regex whitespace between JSON tokens must match.
        structural_tag: vLLM's structural tags; not supported yet (refused).
        kind: (derived) which of the five kinds was given.
        key: (derived) (kind, llguidance grammar text): equal keys compile to the same grammar.
    """

    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    kind: str = field(init=False, default="")
    key: tuple[str, str] = field(init=False, default=("", ""), repr=False)

    def __post_init__(self) -> None:
        kind = _the_kind(self)
        _check_options(self, kind)
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        grammar = _serialize(self, kind)
        error = llguidance.LLMatcher.validate_grammar(grammar, None)
        if error:
            raise StructuredOutputsError(
                f"structured_outputs.{kind}: the {_NOUNS[kind]} is not valid, fix it: "
                f"{llguidance_reason(error)}", param=f"structured_outputs.{kind}",
                value=getattr(self, kind))
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "key", (kind, grammar))

    def __hash__(self) -> int:  # `json` may be a dict: hash what it compiles to
        return hash(self.key)

    @property
    def llguidance_grammar(self) -> str:
        """The grammar as llguidance reads it (what `GrammarCompiler` compiles)."""
        return self.key[1]


_NOUNS = {"json": "JSON schema", "regex": "regex", "choice": "choice list",
          "grammar": "grammar", "json_object": "json_object grammar"}


def llguidance_reason(error: str) -> str:
    """llguidance's error text, fit to show a client. A panic (llguidance hit an internal
    limit; the text is Rust's assertion and backtrace) is logged and summarized instead."""
    if not error.lstrip().startswith("panic") and "<backtrace>" not in error:
        return error.strip()
    logger.warning("llguidance panicked on a request's constraint: %s", error)
    return "llguidance cannot handle it (it is past an internal limit); make it smaller"


def _error(name: str, message: str, value: Any) -> StructuredOutputsError:
    return StructuredOutputsError(f"structured_outputs.{name}: {message}",
                                  param=f"structured_outputs.{name}", value=value)


def _the_kind(p: StructuredOutputsParams) -> str:
    if p.structural_tag is not None:
        raise _error("structural_tag", "structural tags are not supported yet; constrain the "
                     "output with json, regex, choice or grammar instead", p.structural_tag)
    given = [k for k in KINDS if getattr(p, k) is not None]
    if len(given) != 1:
        what = "none is" if not given else f"{len(given)} are ({', '.join(given)})"
        raise StructuredOutputsError(
            f"structured_outputs: give exactly one of {', '.join(KINDS)}; {what} given",
            param="structured_outputs", value=tuple(given))
    kind = given[0]
    value = getattr(p, kind)
    if kind == "json" and not isinstance(value, str | Mapping):
        raise _error("json", f"must be a JSON schema (an object or its JSON text), not "
                     f"{type(value).__name__}", value)
    if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
        raise _error(kind, f"must be a non-empty string, not {value!r}", value)
    if kind == "choice":
        _check_choice(value)
    if kind == "json_object" and value is not True:
        raise _error("json_object", f"must be true when given (got {value!r}); leave it unset "
                     "for no constraint", value)
    return kind


def _check_choice(value: Any) -> None:
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        raise _error("choice", f"must be a non-empty list of non-empty strings, not {value!r}",
                     value)
    if len(value) > MAX_CHOICES:
        raise _error("choice", f"at most {MAX_CHOICES} choices are allowed, got {len(value)}",
                     len(value))
    if not all(isinstance(c, str) and c for c in value):
        raise _error("choice", "must be a non-empty list of non-empty strings; got "
                     f"{next(c for c in value if not (isinstance(c, str) and c))!r} in it",
                     value)
    chars = sum(map(len, value))
    if chars > MAX_CHOICE_CHARS:
        raise _error("choice", f"the choices may have at most {MAX_CHOICE_CHARS} characters "
                     f"in all, got {chars}", chars)


def _check_options(p: StructuredOutputsParams, kind: str) -> None:
    for name in ("disable_any_whitespace", "disable_additional_properties"):
        if not isinstance(getattr(p, name), bool):
            raise _error(name, f"must be a bool, not {getattr(p, name)!r}", getattr(p, name))
    if p.whitespace_pattern is not None and not isinstance(p.whitespace_pattern, str):
        raise _error("whitespace_pattern", "must be a string (a regex)", p.whitespace_pattern)
    if kind not in _JSON_KINDS:
        for name in (*_JSON_OPTIONS, "disable_any_whitespace"):
            if getattr(p, name) not in (None, False):
                raise _error(name, f"shapes JSON output only; it does not apply to {kind}: "
                             "remove it", getattr(p, name))
    if p.disable_any_whitespace and p.whitespace_pattern is not None:
        raise _error("whitespace_pattern", "conflicts with disable_any_whitespace=True; give "
                     "one of them", p.whitespace_pattern)


def _serialize(p: StructuredOutputsParams, kind: str) -> str:
    """The llguidance grammar text of the constraint (as vLLM's serialize_guidance_grammar)."""
    if kind in _JSON_KINDS:
        options: dict[str, Any] = {"whitespace_flexible": not p.disable_any_whitespace}
        if p.whitespace_pattern is not None:
            options["whitespace_pattern"] = p.whitespace_pattern
        schema = _schema(p) if kind == "json" else {"type": "object"}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:
            raise _error(kind, f"the JSON schema is not valid, fix it: "
                         f"{llguidance_reason(str(e))}", p.json) from None
    if kind == "choice":
        return llguidance.grammar_from("choice", jsonlib.dumps(list(p.choice)))
    try:
        return llguidance.grammar_from(kind, getattr(p, kind))
    except ValueError as e:  # a GBNF grammar that does not convert to Lark
        raise _error(kind, f"the {_NOUNS[kind]} is not valid, fix it: "
                     f"{llguidance_reason(str(e))}", getattr(p, kind)) from None


def _schema(p: StructuredOutputsParams) -> dict[str, Any]:
    schema = p.json
    if isinstance(schema, str):
        try:
            schema = jsonlib.loads(schema)
        except ValueError as e:
            raise _error("json", f"the JSON schema is not valid JSON: {e}", p.json) from None
    if not isinstance(schema, Mapping):  # llguidance applies its options to an object only
        raise _error("json", f"the JSON schema must be an object, not "
                     f"{type(schema).__name__}", p.json)
    if p.disable_additional_properties and isinstance(schema, Mapping):
        schema = copy.deepcopy(dict(schema))
        _close_objects(schema)
    return dict(schema)


def _close_objects(node: object) -> None:
    """vLLM's `_walk_json_for_additional_properties`: objects with properties admit no others."""
    if isinstance(node, dict):
        for value in node.values():
            _close_objects(value)
        if "additionalProperties" not in node and ("properties" in node
                                                   or "patternProperties" in node):
            node["additionalProperties"] = False
    elif isinstance(node, list):
        for item in node:
            _close_objects(item)
