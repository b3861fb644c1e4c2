"""GrammarMatcher and GrammarCompiler with SmolLM2's tokenizer: accept, reject, roll back,
terminate; asynchronous compilation and its cache."""

import threading

import numpy as np
import pytest

from jaxengine.structured import (
    GrammarCompiler,
    StructuredOutputsError,
    StructuredOutputsParams,
    allocate_bitmask,
    fill_bitmasks,
)


def _allowed(matcher, vocab: int) -> set[int]:
    mask = allocate_bitmask(1, vocab)
    fill_bitmasks([matcher], mask)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.hf.encode(text, add_special_tokens=False)


def test_choice_allows_only_prefixes_then_only_eos(compiler, tokenizer) -> None:
    m = compiler.compile(StructuredOutputsParams(choice=["yes", "no"])).matcher()
    vocab, eos = compiler.vocab_size, tokenizer.eos_token_id
    first = _allowed(m, vocab)
    texts = {tokenizer.hf.decode([t]) for t in first}
    assert texts <= {"y", "ye", "yes", "n", "no"} and {"yes", "no"} <= texts
    assert eos not in first
    assert m.accept_tokens(_ids(tokenizer, "yes"))
    assert m.is_accepting and not m.is_terminated
    assert _allowed(m, vocab) == {eos}  # the text is complete: only EOS
    assert m.accept_tokens([eos]) and m.is_terminated


def test_a_disallowed_token_is_refused_and_the_error_kept(compiler, tokenizer) -> None:
    m = compiler.compile(StructuredOutputsParams(regex="[0-9]+")).matcher()
    assert m.error is None
    assert not m.accept_tokens(_ids(tokenizer, "x"))
    assert m.error


def test_validate_and_rollback_drafts(compiler, tokenizer) -> None:
    m = compiler.compile(StructuredOutputsParams(regex="ab[0-9]{2}")).matcher()
    a, b, one = (_ids(tokenizer, s)[0] for s in ("a", "b", "1"))
    x = _ids(tokenizer, "x")[0]
    assert m.validate_tokens([a, b, one, x]) == 3  # x breaks the pattern; nothing advanced
    before = _allowed(m, compiler.vocab_size)
    assert m.accept_tokens([a, b, one])
    m.rollback(2)  # two drafts rejected
    assert m.accept_tokens([b])
    m.rollback(2)
    assert _allowed(m, compiler.vocab_size) == before
    with pytest.raises(ValueError, match="num_tokens=-1"):
        m.rollback(-1)


def test_rollback_past_eos_after_the_grammar_stopped(compiler, tokenizer) -> None:
    m = compiler.compile(StructuredOutputsParams(choice=["no"])).matcher()
    no, eos = _ids(tokenizer, "no"), tokenizer.eos_token_id
    assert m.accept_tokens([*no, eos]) and m.is_terminated
    m.rollback(1 + len(no))  # EOS was not consumed by llguidance: the lag is counted
    assert not m.is_terminated
    assert m.accept_tokens(no) and _allowed(m, compiler.vocab_size) == {eos}


def test_batch_fill_rows_without_grammar_are_all_ones(compiler, tokenizer) -> None:
    grammar = compiler.compile(StructuredOutputsParams(regex="[0-9]+"))
    m1, m2, done = grammar.matcher(), grammar.matcher(), grammar.matcher()
    assert m2.accept_tokens(_ids(tokenizer, "12"))
    assert done.accept_tokens([*_ids(tokenizer, "7"), tokenizer.eos_token_id])
    matchers = [m1, None, m2, done]
    serial = fill_bitmasks(matchers, allocate_bitmask(5, compiler.vocab_size) * 0)
    parallel = fill_bitmasks(matchers, allocate_bitmask(5, compiler.vocab_size) * 0,
                             compiler.executor)
    np.testing.assert_array_equal(serial, parallel)
    assert serial.shape == (5, compiler.bitmask_width) == (5, 49152 // 32)
    assert (serial[1] == -1).all() and (serial[3] == -1).all()  # no grammar; terminated
    assert (serial[4] == 0).all()  # padding row left as it was
    assert not (serial[0] == -1).all()
    assert tokenizer.eos_token_id not in _allowed(m1, compiler.vocab_size)
    assert tokenizer.eos_token_id in _allowed(m2, compiler.vocab_size)  # "12" is complete


def test_fill_refuses_a_wrong_array(compiler) -> None:
    m = compiler.compile(StructuredOutputsParams(regex="a")).matcher()
    with pytest.raises(ValueError, match="R >= 2"):
        fill_bitmasks([m, m], allocate_bitmask(1, compiler.vocab_size))
    with pytest.raises(ValueError, match="int64"):
        m.fill_bitmask(np.zeros(compiler.bitmask_width, np.int64))


def test_submit_is_asynchronous_and_cached(compiler) -> None:
    params = StructuredOutputsParams(regex="[a-f]{4}-async")
    future = compiler.submit(params)
    assert compiler.submit(StructuredOutputsParams(regex="[a-f]{4}-async")) is future
    assert future.result(timeout=30) is compiler.compile(params)
    names = {t.name for t in threading.enumerate()}
    assert any(n.startswith("grammar-compile") for n in names)


def test_the_cache_drops_the_least_recently_used(tokenizer) -> None:
    c = GrammarCompiler(tokenizer, cache_size=2, max_workers=1)
    try:
        a, b, d = (StructuredOutputsParams(regex=r) for r in ("a", "b", "d"))
        fa = c.submit(a)
        c.submit(b)
        assert c.submit(a) is fa  # a is now the most recent
        c.submit(d)  # drops b
        assert c.submit(a) is fa
        assert c.submit(b) is not None and c.submit(d) is not None
    finally:
        c.shutdown()


def test_a_padded_vocabulary_never_allows_the_padding(tokenizer) -> None:
    c = GrammarCompiler(tokenizer, vocab_size=49152 + 40)
    try:
        assert c.vocab_size == 49192 and c.bitmask_width == 1538
        m = c.compile(StructuredOutputsParams(json_object=True)).matcher()
        assert max(_allowed(m, c.vocab_size)) < 49152
    finally:
        c.shutdown()


def test_bad_compiler_arguments(tokenizer) -> None:
    with pytest.raises(ValueError, match="vocab_size=100 is below"):
        GrammarCompiler(tokenizer, vocab_size=100)
    with pytest.raises(ValueError, match="max_workers=0"):
        GrammarCompiler(tokenizer, max_workers=0)


def test_structured_outputs_error_is_raised_by_the_future_for_a_tokenizer_error(
        compiler, tokenizer) -> None:
    # A special token literal that this tokenizer does not have compiles to an error only
    # against the tokenizer (validation without one accepts it).
    params = StructuredOutputsParams(grammar="start: <|no_such_special_token|>")
    with pytest.raises(StructuredOutputsError) as info:
        compiler.compile(params)
    assert info.value.param == "structured_outputs.grammar"
