"""Generation under a grammar with SmolLM2's real tokenizer and random logits.

Each loop samples the argmax of random logits masked by the request's bitmask (filled by
`fill_bitmasks`, applied by the jitted `apply_token_bitmask`) until the matcher says the
grammar is finished; the decoded text must then satisfy the constraint, checked independently
of llguidance (json + jsonschema, Python's `re`).
"""

import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jaxengine.loading.tokenizer import Tokenizer
from jaxengine.structured import (
    GrammarCompiler,
    StructuredOutputsParams,
    allocate_bitmask,
    apply_token_bitmask,
    fill_bitmasks,
)

SEEDS = range(4)
MAX_STEPS = 400
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
_apply = jax.jit(apply_token_bitmask)


def _generate(compiler: GrammarCompiler, tokenizer: Tokenizer, params: StructuredOutputsParams,
              seed: int, bias: np.ndarray | None = None) -> str:
    """Sample until the grammar ends; `bias` (f32[V]) is added step times, to end sooner."""
    rng = np.random.default_rng(seed)
    matcher = compiler.compile(params).matcher()
    vocab = compiler.vocab_size
    mask = allocate_bitmask(1, vocab)
    out: list[int] = []
    for step in range(MAX_STEPS):
        fill_bitmasks([matcher], mask)
        logits = rng.standard_normal((1, vocab)).astype(np.float32)
        if bias is not None:
            logits += step * bias
        token = int(jnp.argmax(_apply(jnp.asarray(logits), jnp.asarray(mask))))
        assert matcher.accept_tokens([token]), matcher.error
        if matcher.is_terminated:
            assert token in tokenizer.eos_token_ids
            return tokenizer.hf.decode(out)
        assert token not in tokenizer.eos_token_ids
        out.append(token)
    raise AssertionError(f"the grammar did not end in {MAX_STEPS} tokens: "
                         f"{tokenizer.hf.decode(out)!r}")


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_output_parses_and_validates(compiler, tokenizer, seed) -> None:
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    text = _generate(compiler, tokenizer, params, seed)
    jsonschema.validate(json.loads(text), SCHEMA)
    outside_strings = re.sub(r'"(\\.|[^"\\])*"', "", text)
    assert not re.search(r"\s", outside_strings), text  # disable_any_whitespace


def test_json_schema_given_as_text_compiles_to_the_same_grammar(compiler) -> None:
    as_dict = StructuredOutputsParams(json=SCHEMA)
    as_text = StructuredOutputsParams(json=json.dumps(SCHEMA))
    assert as_dict.key == as_text.key
    assert compiler.submit(as_dict) is compiler.submit(as_text)  # one cache entry


@pytest.mark.parametrize("seed", SEEDS)
def test_json_object_output_is_a_json_object(compiler, tokenizer, seed) -> None:
    # Random logits wander for long inside a free-form object: bias the tokens made of
    # closing characters more each step, so the object ends within MAX_STEPS.
    pieces = tokenizer.hf.convert_ids_to_tokens(list(range(compiler.vocab_size)))
    closing = np.array([bool(p) and all(ch in '"}]' for ch in p) for p in pieces], np.float32)
    text = _generate(compiler, tokenizer, StructuredOutputsParams(json_object=True), seed,
                     bias=0.1 * closing)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("seed", SEEDS)
def test_regex_output_fully_matches(compiler, tokenizer, seed) -> None:
    pattern = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
    text = _generate(compiler, tokenizer, StructuredOutputsParams(regex=pattern), seed)
    assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("seed", SEEDS)
def test_choice_output_is_one_of_the_choices(compiler, tokenizer, seed) -> None:
    choices = ["positive", "negative", "neutral", "neutral-ish"]
    text = _generate(compiler, tokenizer, StructuredOutputsParams(choice=choices), seed)
    assert text in choices


@pytest.mark.parametrize("seed", SEEDS)
def test_lark_grammar_output_is_in_the_language(compiler, tokenizer, seed) -> None:
    grammar = 'start: greeting " " name "!"\ngreeting: "hello" | "hi"\nname: /[A-Z][a-z]{1,6}/'
    text = _generate(compiler, tokenizer, StructuredOutputsParams(grammar=grammar), seed)
    assert re.fullmatch(r"(hello|hi) [A-Z][a-z]{1,6}!", text), text


@pytest.mark.parametrize("seed", SEEDS)
def test_gbnf_grammar_output_is_in_the_language(compiler, tokenizer, seed) -> None:
    grammar = 'root ::= ("yes" | "no") "," [0-9] [0-9]?'
    text = _generate(compiler, tokenizer, StructuredOutputsParams(grammar=grammar), seed)
    assert re.fullmatch(r"(yes|no),[0-9][0-9]?", text), text
