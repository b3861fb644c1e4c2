"""`jaxengine export-tokenizer`: the written HF directory tokenizes, decodes and renders chat
exactly as the engine does, read back by transformers' `AutoTokenizer` and by our loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from jaxengine.cli import main
from jaxengine.loading import load_tokenizer
from jaxengine.loading.tokenizer import Tokenizer
from tests.fixtures.model_helpers import DEFAULT_DIR, load_json

TEXTS = [s["text"] for s in load_json(DEFAULT_DIR / "tokenizer.json")["strings"]]
CHAT = load_json(DEFAULT_DIR / "greedy.json")["messages"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tok") / "smollm2"
    assert main(["export-tokenizer", str(directory)]) == 0
    return directory


def test_the_directory_holds_an_hf_tokenizer(exported: Path) -> None:
    assert {p.name for p in exported.iterdir()} >= {"tokenizer.json", "tokenizer_config.json"}
    config = json.loads((exported / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")


def test_transformers_reads_it_back_with_the_engines_ids_and_template(exported: Path) -> None:
    ours = load_tokenizer(None)
    hf = AutoTokenizer.from_pretrained(str(exported))
    for text in [*TEXTS, "<|im_start|>user\nhi<|im_end|>"]:
        assert hf.encode(text) == ours.encode(text), text
        ids = ours.encode(text, add_special_tokens=False)
        assert hf.decode(ids) == ours.decode(ids, skip_special_tokens=False)
    assert hf.eos_token_id == ours.eos_token_id and hf.bos_token_id == ours.bos_token_id
    assert hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == (
        ours.apply_chat_template(CHAT, add_generation_prompt=True))


def test_our_loader_reads_it_back(exported: Path) -> None:
    ours, back = load_tokenizer(None), load_tokenizer(str(exported))
    assert [back.encode(t) for t in TEXTS] == [ours.encode(t) for t in TEXTS]
    assert (back.eos_token_ids, back.bos_token_id, back.pad_token_id) == (
        ours.eos_token_ids, ours.bos_token_id, ours.pad_token_id)
    assert back.apply_chat_template(CHAT) == ours.apply_chat_template(CHAT)


def test_a_gguf_add_bos_token_is_kept_in_the_file(tmp_path: Path) -> None:
    ours = load_tokenizer(None)
    with_bos = Tokenizer.from_backend(ours.backend, eos_token_id=ours.eos_token_id,
                                      bos_token_id=ours.bos_token_id, add_bos=True)
    with_bos.save_pretrained(str(tmp_path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.encode("hello") == with_bos.encode("hello") == [ours.bos_token_id,
                                                              *ours.encode("hello")]
    assert ours.encode("hello") == ours.backend.encode("hello").ids  # the source is untouched
