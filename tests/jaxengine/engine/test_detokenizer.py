"""Incremental detokenization equals a full decode; stop strings trim as vLLM does.

The tokenizers are real `tokenizers` pipelines at tiny sizes (tests/fixtures/char_tokenizer.py),
so the decode stream the engine uses is the one under test."""

from __future__ import annotations

import logging
import string

import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from jaxengine.engine.detokenizer import IncrementalDetokenizer
from jaxengine.loading.tokenizer import Tokenizer
from tests.fixtures.char_tokenizer import char_tokenizer

# token t < 26 is the t-th lower-case letter; 26 is a special token, no text by default
TOK = char_tokenizer([*string.ascii_lowercase, "<s>"], eos="<s>")


def _run(text: str, **kw: object) -> tuple[IncrementalDetokenizer, str | None, int]:
    d = IncrementalDetokenizer(TOK, [1, 2, 3], **kw)
    for n, t in enumerate(TOK.encode(text), start=1):
        hit = d.update([t])
        if hit is not None:
            return d, hit, n
    return d, None, len(text)


def test_text_accumulates_and_special_tokens_are_skipped() -> None:
    d = IncrementalDetokenizer(TOK, [5])
    d.update([7, 26, 8])
    d.update([9])
    assert d.output_text == "hij"
    assert d.num_output_tokens == 4


def test_stop_string_across_tokens_trims_the_text() -> None:
    d, hit, n = _run("hellostopworld", stop=("stop",))
    assert hit == "stop" and n == 9  # found when the 'p' arrived
    assert d.output_text == "hello"


def test_stop_string_can_be_kept_in_the_output() -> None:
    d, hit, _ = _run("hellostopworld", stop=("stop",), include_stop_str_in_output=True)
    assert hit == "stop" and d.output_text == "hellostop"


def test_first_matching_stop_string_in_the_list_wins() -> None:
    d, hit, _ = _run("abcxyz", stop=("yz", "cx"))
    assert hit == "cx" and d.output_text == "ab"


def test_stop_strings_are_ignored_before_min_tokens() -> None:
    d, hit, n = _run("abab", stop=("ab",), min_tokens=2)
    assert hit == "ab" and n == 4 and d.output_text == "ab"


def test_a_dropped_stop_token_counts_but_shows_no_text() -> None:
    d = IncrementalDetokenizer(TOK, [1])
    d.update([7])
    d.update([8])  # the engine decodes it before the scheduler says it was a stop token id
    d.drop_last_token()
    assert d.output_text == "h" and d.num_output_tokens == 2


def test_running_text_holds_back_a_possible_stop_string_prefix() -> None:
    d, hit, _ = _run("hello", stop=("xyz",))
    assert hit is None
    assert d.visible_text(finished=False) == "hel"
    assert d.visible_text(finished=True) == "hello"


def byte_level() -> Tokenizer:
    """A byte-level tokenizer with no merges: multi-byte characters span several tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    bpe = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([AddedToken("<|eos|>", special=True, normalized=False)])
    return Tokenizer.from_backend(bpe, eos_token_id=bpe.token_to_id("<|eos|>"))


@pytest.mark.parametrize("text", ["Hello, world! ünïcödé 日本語 🙂🚀 done.", "  spaces\n\ttabs"])
def test_byte_level_bpe_incremental_equals_full_decode(text: str) -> None:
    bpe = byte_level()
    ids = bpe.encode(text)
    d = IncrementalDetokenizer(bpe, [])
    seen = []
    for t in ids:
        d.update([t])
        seen.append(d.output_text)
    assert d.output_text == text
    assert all("\ufffd" not in s for s in seen)  # partial characters never leak


@pytest.mark.parametrize("prompt", ["日本語", "x 🙂🚀", "ab", "a long prompt that ends in ü"])
def test_output_after_a_prompt_is_the_full_decode_past_the_prompt(prompt: str) -> None:
    """The stream starts from a prompt suffix on a character boundary (4-token suffixes of
    these prompts start inside a character), so the output is exactly the new text."""
    bpe = byte_level()
    prompt_ids, out_ids = bpe.encode(prompt), bpe.encode("🙂 ok, ünï")
    d = IncrementalDetokenizer(bpe, prompt_ids)
    for t in out_ids:
        d.update([t])
    assert d.output_text == "🙂 ok, ünï"


def test_first_word_after_the_prompt_keeps_its_leading_space() -> None:
    """SentencePiece's Metaspace drops the space of a sequence's first word; decoded after the
    prompt, as vLLM does, the first generated word keeps it."""
    tok = char_tokenizer(["▁Hello", "▁world", ",", "</s>"], eos="</s>",
                         decoder=decoders.Metaspace())
    assert tok.decode([1]) == "world"
    d = IncrementalDetokenizer(tok, [0])
    d.update([1, 2])
    assert d.output_text == " world,"


def test_a_decoder_that_rewrites_its_output_restarts_the_stream(caplog: pytest.LogCaptureFixture
                                                                ) -> None:
    """Byte fallback turns E6 97 97 into 旗, but E6 97 97 F0 into four U+FFFD: the decoded text
    no longer extends what was shown. As vLLM does, the stream restarts instead of failing."""
    llama2 = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok = char_tokenizer(["<0xE6>", "<0x97>", "<0xF0>", "a", "</s>"], eos="</s>",
                         decoder=llama2)
    d = IncrementalDetokenizer(tok, [])
    with caplog.at_level(logging.WARNING, logger="jaxengine.engine"):
        d.update([0, 1, 1, 2, 3])
    assert d.output_text == "旗a"
    assert "restarting the decode stream" in caplog.text
