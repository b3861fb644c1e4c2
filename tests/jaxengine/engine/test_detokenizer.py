"""Incremental detokenization equals a full decode; stop strings trim as vLLM does."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from jaxengine.engine.detokenizer import IncrementalDetokenizer


class CharTokenizer:
    """Token t < 26 is the t-th lower-case letter; 26 is a special token decoded to ''."""

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return "".join("" if t == 26 and skip_special_tokens else chr(97 + t % 26) for t in ids)

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 97 for c in text]


TOK = CharTokenizer()


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


def test_skip_last_counts_but_does_not_decode_the_stop_token() -> None:
    d = IncrementalDetokenizer(TOK, [1])
    d.update([7, 8], skip_last=True)
    assert d.output_text == "h" and d.num_output_tokens == 2


def test_running_text_holds_back_a_possible_stop_string_prefix() -> None:
    d, hit, _ = _run("hello", stop=("xyz",))
    assert hit is None
    assert d.visible_text(finished=False) == "hel"
    assert d.visible_text(finished=True) == "hello"


@pytest.mark.parametrize("text", ["Hello, world! ünïcödé 日本語 🙂🚀 done.", "  spaces\n\ttabs"])
def test_byte_level_bpe_incremental_equals_full_decode(text: str) -> None:
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    # a byte-level tokenizer with no merges: multi-byte characters span several tokens
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    bpe = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()

    class Wrapped:
        def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
            return bpe.decode(list(ids), skip_special_tokens=skip_special_tokens)

    ids = bpe.encode(text).ids
    d = IncrementalDetokenizer(Wrapped(), [])
    seen = []
    for t in ids:
        d.update([t])
        seen.append(d.output_text)
    assert d.output_text == text
    assert all("\ufffd" not in s for s in seen)  # partial characters never leak
