"""The torch-free tokenizer: the GGUF-built byte-level BPE gives transformers' ids and chat
template; HF-directory tokenizers load from tokenizer.json."""

from __future__ import annotations

import datetime

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, normalizers

from jaxengine.loading import load_model
from jaxengine.loading.tokenizer import Tokenizer
from jaxengine.model.config import ModelLoadError
from tests.fixtures.model_helpers import DEFAULT_DIR, FIXTURES, default_model, load_json

EXPECTED = load_json(DEFAULT_DIR / "tokenizer.json")
CHAT = load_json(DEFAULT_DIR / "greedy.json")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return default_model()[2]


@pytest.mark.parametrize("case", EXPECTED["strings"], ids=lambda c: repr(c["text"][:12]))
def test_ids_equal_transformers(tok: Tokenizer, case: dict) -> None:
    ids = tok.encode(case["text"], add_special_tokens=False)
    assert ids == case["ids"]
    assert tok.decode(ids, skip_special_tokens=False) == case["decoded"]


def test_special_tokens(tok: Tokenizer) -> None:
    specials = EXPECTED["special_ids"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        specials["bos"], specials["eos"], specials["pad"])
    assert tok.vocab_size == 49152
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # add_bos_token=False
    ids = tok.encode("<|im_start|>user<|im_end|>")
    assert tok.decode(ids) == "user"  # specials skipped by default


def test_chat_template_equals_transformers(tok: Tokenizer) -> None:
    text = tok.apply_chat_template(CHAT["messages"], add_generation_prompt=True)
    assert text == CHAT["chat_text"]
    assert tok.apply_chat_template(CHAT["messages"], tokenize=True) == CHAT["prompt_ids"]
    without = tok.apply_chat_template(CHAT["messages"], add_generation_prompt=False)
    assert not without.endswith("assistant\n")


# Text a tokenizer may treat specially: digits, whitespace runs, newlines, accents, CJK, emoji,
# contractions, special tokens inline and glued to words, a partial special token.
VARIED = ["", " ", "  two  spaces\n\n\tand tabs ", "1234567 + 3.14159 = x", "I'll've don't",
          "café naïve Ωμέγα", "日本語のテキスト", "emoji 🤖👩‍👩‍👧 end",
          "<|im_start|>user\nhi<|im_end|>\n", "a<|endoftext|>b", "<|im_start", "  <|im_end|>  ",
          "\u200b\u00a0zero width"]


@pytest.mark.parametrize("add_bos", [False, True])
def test_tokenizers_alone_encode_decode_and_render_as_transformers(tok: Tokenizer,
                                                                   add_bos: bool) -> None:
    # `encode`/`decode` go through `tokenizers` alone; `hf` is transformers' tokenizer over
    # the same pipeline, which a start builds only for chat templates
    ours = tok if not add_bos else Tokenizer.from_backend(
        tok.backend, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
        chat_template=tok.chat_template, add_bos=True)
    hf = ours.hf
    assert (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id) == (
        ours.eos_token_id, ours.bos_token_id, ours.pad_token_id)
    for text in VARIED:
        for special in (False, True):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), (text, special)
            for skip in (False, True):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                    ids, skip_special_tokens=skip), (text, skip)
    assert (ours.encode("x")[0] == ours.bos_token_id) == add_bos
    messages = [*CHAT["messages"], {"role": "assistant", "content": VARIED[8]},
                {"role": "user", "content": VARIED[7]}]
    text = ours.apply_chat_template(messages)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages, tokenize=True) == hf.encode(
        text, add_special_tokens=False)


def test_hf_directory_tokenizer() -> None:
    _, _, tok = load_model(str(FIXTURES / "tiny" / "qwen2_bias_tied"))
    ids = tok.encode("Hi!\n")
    assert tok.decode(ids) == "Hi!\n"
    assert tok.eos_token_id == tok.backend.token_to_id("<|im_end|>")
    prompt = tok.apply_chat_template([{"role": "user", "content": "yo"}], tokenize=True)
    assert prompt[0] == tok.backend.token_to_id("<|im_start|>")
    assert tok.decode(prompt) == "user\nyo\nassistant\n"


def test_unsupported_gguf_tokenizer_is_named() -> None:
    with pytest.raises(ModelLoadError, match="'llama'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama"})
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "jais",
            "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": []}
    with pytest.raises(ModelLoadError, match="'jais'"):
        Tokenizer.from_gguf_metadata(meta)


def test_chat_templates_render_with_transformers_jinja_extensions() -> None:
    # `{% break %}` needs jinja's loopcontrols; `strftime_now` is how Llama-3 templates date
    # their system prompt. transformers provides both; a bare jinja environment does not.
    template = ("{{ strftime_now('%d %b %Y') }}|{% for m in messages %}{{ m['content'] }}"
                "{% if m['role'] == 'user' %}{% break %}{% endif %}{% endfor %}")
    base = default_model()[2]
    tok = Tokenizer.from_backend(base.backend, eos_token_id=base.eos_token_id,
                                 chat_template=template)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": "never"}]
    before = datetime.datetime.now().strftime("%d %b %Y")
    text = tok.apply_chat_template(messages)
    assert text in (f"{before}|su", f"{datetime.datetime.now().strftime('%d %b %Y')}|su")


def test_no_text_has_fewer_tokens_than_max_chars_per_token_says(tok: Tokenizer) -> None:
    # SmolLM2's longest token is 80 "#"s; the densest texts are made of long tokens
    bound = tok.max_chars_per_token()
    assert bound == 81
    for text in ("#" * 10_000, " " * 10_000, "\n" + " " * 80, "é" * 1000, "日本語" * 500,
                 " the" * 2000, "<|im_start|>" * 100):
        assert len(text) <= bound * len(tok.encode(text, add_special_tokens=False)), text[:20]


def test_a_composing_normalizer_multiplies_max_chars_per_token() -> None:
    vocab = {"a": 0, "b": 1, "c": 2, "é": 3, "ab": 4, "abc": 5}
    backend = Backend(models.BPE(vocab=vocab, merges=[("a", "b"), ("ab", "c")]))
    plain = Tokenizer.from_backend(backend, eos_token_id=0)
    assert plain.max_chars_per_token() == 3
    backend.normalizer = normalizers.Sequence([normalizers.NFC()])
    nfc = Tokenizer.from_backend(backend, eos_token_id=0)
    assert nfc.max_chars_per_token() == 12
    # "e" and a combining acute accent compose into the one token "é"
    assert nfc.encode("e\u0301", add_special_tokens=False) == [3]
