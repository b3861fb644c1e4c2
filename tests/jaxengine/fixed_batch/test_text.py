"""`encode_batch` / `decode_batch`: strings to left-padded id arrays and a `GenerateOutput` back
to text, with the character-level tokenizer of the tiny fixtures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxengine import GenerateOutput, decode_batch, encode_batch
from jaxengine.llm import chat_prompt
from jaxengine.loading import load_tokenizer

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny" / "llama_tied_mha"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(TINY))


def test_text_ids_and_conversations_are_left_padded(tokenizer) -> None:
    conv = [{"role": "user", "content": "Hi"}]
    ids, lens = encode_batch(tokenizer, ["abc", [5, 6], conv], pad_id=-7)
    rows = [tokenizer.encode("abc"), [5, 6], chat_prompt(tokenizer, conv)["prompt_token_ids"]]
    S = max(map(len, rows))
    assert ids.shape == (3, S) and ids.dtype == np.int32 and lens.tolist() == [3, 2, len(rows[2])]
    for b, row in enumerate(rows):
        assert ids[b, S - len(row):].tolist() == row
        assert ids[b, :S - len(row)].tolist() == [-7] * (S - len(row))


def test_one_prompt_is_a_batch_of_one_and_width_pads_further(tokenizer) -> None:
    ids, lens = encode_batch(tokenizer, "hello", width=8)
    assert ids.tolist() == [[0, 0, 0] + tokenizer.encode("hello")] and lens.tolist() == [5]
    conv = [{"role": "user", "content": "x"}]
    assert encode_batch(tokenizer, conv)[0].tolist() == encode_batch(tokenizer, [conv])[0].tolist()


def test_continuations_are_right_padded(tokenizer) -> None:
    ids, lens = encode_batch(tokenizer, ["ab", "c"], padding_side="right", pad_id=-1,
                             add_special_tokens=False)
    assert ids.tolist() == [tokenizer.encode("ab"), tokenizer.encode("c") + [-1]]
    assert lens.tolist() == [2, 1]
    with pytest.raises(ValueError, match="padding_side must be 'left' or 'right'"):
        encode_batch(tokenizer, ["ab"], padding_side="middle")


@pytest.mark.parametrize("prompts, width, match", [
    (["hello world"], 4, "has 11 tokens, more than width=4"),
    ([], None, "no prompts"),
    (["a", ""], None, "prompt 1 has no tokens"),
    ([3.5], None, "must be a string, a list of token ids or a conversation"),
])
def test_bad_prompts_say_what_to_change(tokenizer, prompts, width, match) -> None:
    with pytest.raises(ValueError, match=match):
        encode_batch(tokenizer, prompts, width=width)


def test_decode_stops_at_the_length_and_leaves_out_eos(tokenizer) -> None:
    eos = tokenizer.eos_token_id
    a, b = tokenizer.encode("hi"), tokenizer.encode("yes")
    tokens = np.asarray([a + [eos, 0, 0], b + [9, 9]], np.int32)  # i32[2, 5]
    out = GenerateOutput(tokens=tokens, lengths=np.asarray([3, 3], np.int32),
                         logprobs=np.zeros((2, 5), np.float32),
                         top_logprobs=np.zeros((2, 5, 0), np.float32),
                         top_token_ids=np.zeros((2, 5, 0), np.int32))
    assert decode_batch(tokenizer, out) == ["hi", "yes"]
    # EOS is cut as the engine's text cuts it, not because it is a special token
    assert decode_batch(tokenizer, out, skip_special_tokens=False) == ["hi", "yes"]
