"""generation_config.json: which keys become default sampling parameters, and `LLM` using them."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from jaxengine.engine.args import EngineArgs
from jaxengine.llm import LLM
from jaxengine.loading.generation_config import diff_sampling_params
from jaxengine.model.config import ModelLoadError
from jaxengine.model.fake import fake_greedy, fake_model
from scheduler import SamplingParams
from tests.engine_helpers import engine_over
from tests.jaxengine.engine.test_llm_engine import EOS, FakeTokenizer, V

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny" / "llama_tied_mha"
# What a Qwen-style file holds: the sampling keys vLLM takes, and non-sampling keys.
QWEN_LIKE = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.7,
             "top_p": 0.8, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05,
             "max_new_tokens": 7, "transformers_version": "4.51.0"}


def _dir_with(tmp_path: Path, config: Any, name: str = "m") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "generation_config.json").write_text(json.dumps(config))
    return d


def test_the_keys_vllm_takes_that_we_implement(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    d = _dir_with(tmp_path, QWEN_LIKE)
    with caplog.at_level(logging.INFO, logger="jaxengine.loading"):
        got = diff_sampling_params(str(d))
    assert got == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
                   "repetition_penalty": 1.05,
                   "max_tokens": 7}  # max_new_tokens is HF's name for max_tokens
    assert "default sampling parameters from" in caplog.text and "1.05" in caplog.text


def test_no_defaults_without_a_file_for_gguf_and_with_vllm(tmp_path: Path) -> None:
    d = _dir_with(tmp_path, QWEN_LIKE)
    assert diff_sampling_params(str(d), "vllm") == {}
    assert diff_sampling_params(str(TINY)) == {}  # an HF directory without the file
    assert diff_sampling_params(None) == {}  # the embedded default (a GGUF)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert diff_sampling_params(str(gguf)) == {}
    only_tokens = _dir_with(tmp_path, {"bos_token_id": 1, "temperature": None}, "tokens")
    assert diff_sampling_params(str(only_tokens)) == {}


def test_an_explicit_directory_replaces_the_models_file(tmp_path: Path) -> None:
    other = _dir_with(tmp_path, {"top_k": 3}, "other")
    assert diff_sampling_params(str(_dir_with(tmp_path, QWEN_LIKE)), str(other)) == {"top_k": 3}
    with pytest.raises(ModelLoadError, match="'auto' .* or 'vllm'"):
        diff_sampling_params(None, str(tmp_path))


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "cannot be read as JSON"),
    ("[1, 2]", "must hold a JSON object"),
    (json.dumps({"top_p": 0}), r"top_p=0 is not a usable default \(top_p must be in"),
    (json.dumps({"max_new_tokens": -1}), "max_new_tokens=-1"),
])
def test_a_bad_file_is_a_load_error_naming_it(tmp_path: Path, content: str,
                                              message: str) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "generation_config.json").write_text(content)
    with pytest.raises(ModelLoadError, match=message) as info:
        diff_sampling_params(str(d))
    assert "generation_config.json" in str(info.value)


def _fake_llm(model: Path | None, **kw: Any) -> LLM:
    args = EngineArgs(model=None if model is None else str(model), max_num_batched_tokens=32,
                      max_num_seqs=4, block_size=4, **kw)
    return LLM.from_engine(engine_over(fake_model(V), args, tokenizer=FakeTokenizer(),
                                       max_model_len=128, num_blocks=64))


def test_llm_uses_the_models_defaults_when_given_no_params(tmp_path: Path) -> None:
    d = _dir_with(tmp_path, {"temperature": 0.0, "top_k": 5, "max_new_tokens": 6})
    prompt = [5, 6, 7, 8]
    expected = fake_greedy(prompt, 6, V)
    assert EOS not in expected  # so all six tokens come out
    llm = _fake_llm(d)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_k=5,
                                                               max_tokens=6)
    out = llm.generate({"prompt_token_ids": prompt}, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == expected  # greedy, six tokens
    # explicit params win over the model's defaults, field by field
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == fake_greedy(prompt, 16, V)  # max_tokens=16
    assert _fake_llm(d, generation_config="vllm").get_default_sampling_params() == \
        SamplingParams()
    assert _fake_llm(None).get_default_sampling_params() == SamplingParams()


def test_llm_on_a_real_model_directory_with_a_generation_config(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    shutil.copytree(TINY, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 3, "repetition_penalty": 1.2}))
    llm = LLM(str(model), max_num_batched_tokens=64, max_num_seqs=4, block_size=4,
              max_model_len=64, num_gpu_blocks_override=64)
    assert llm.get_default_sampling_params() == SamplingParams(
        temperature=0.0, max_tokens=3, repetition_penalty=1.2)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    default = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    explicit = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3,
                                                   repetition_penalty=1.2),
                            use_tqdm=False)[0].outputs[0]
    assert default.token_ids == explicit.token_ids and len(default.token_ids) <= 3
