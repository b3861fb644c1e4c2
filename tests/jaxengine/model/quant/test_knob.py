"""The `quantization` knob end to end: `LLM(quantization=...)` through the engine (packing left
out, the same tokens as the fixed-batch `generate` of the same quantized weights), `score` of
them, the CLI flag, and the refusals: an unknown value, `batch_invariant` with quantized weights
and a checkpoint stored quantized."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxengine import LLM, SamplingParams, encode_batch, generate, load_model_fns, score
from jaxengine.cli import build_parser
from jaxengine.engine.args import EngineArgs
from jaxengine.flags import engine_args_from
from jaxengine.loading import load_model
from jaxengine.model.config import ModelLoadError

TINY = Path(__file__).resolve().parents[3] / "fixtures" / "tiny" / "llama_tied_mha"
PROMPTS = [[5, 6, 7, 8], list(range(10, 31)), [3, 1, 4, 1, 5, 9, 2, 6]]


@pytest.mark.parametrize("name", ["int8", pytest.param("fp8", marks=pytest.mark.slow)])
def test_llm_serves_quantized_weights_as_generate_computes_them(name: str) -> None:
    """The engine (scheduler, paged cache, the CPU defaults) and the fixed-batch loop run the
    same quantized weights: the same greedy tokens, logprobs within float noise; and `score`
    of those tokens finds them greedy."""
    llm = LLM(str(TINY), skip_tokenizer_init=True, quantization=name, max_num_seqs=4,
              block_size=4, max_num_batched_tokens=32, num_gpu_blocks_override=80,
              max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    fns, _ = load_model_fns(str(TINY), quantization=name, block_size=4)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids, lens = encode_batch(None, [prompt])
        gen = generate(fns, ids, lens, max_new_tokens=6, block_size=4)
        completion = out.outputs[0]
        assert list(completion.token_ids) == np.asarray(gen.tokens)[0].tolist()
        got = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids,
                                                   strict=True)]
        np.testing.assert_allclose(got, np.asarray(gen.logprobs)[0], atol=2e-3, rtol=0)
        scored = score(fns, ids, gen.tokens, lens, block_size=4)
        assert np.asarray(scored.is_greedy).all()


def test_the_quantization_flag_reaches_engine_args() -> None:
    parser = build_parser()
    ns = parser.parse_args(["serve", "--quantization", "int8"])
    assert engine_args_from(ns, parser).quantization == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--quantization", "awq"])


@pytest.mark.parametrize("kw, message", [
    ({"quantization": "awq"}, r"quantization must be one of int8, fp8, gguf; got 'awq'"),
    ({"quantization": "int8", "batch_invariant": True},
     r"batch_invariant=True needs float weights .* quantization='int8'"),
])
def test_bad_settings_are_refused_naming_the_field(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kw)
    with pytest.raises(ValueError, match=message):
        LLM(str(TINY), skip_tokenizer_init=True, **kw)


def test_load_model_refuses_an_unknown_quantization() -> None:
    with pytest.raises(ValueError, match=r"quantization='gptq' is not supported; use one of "
                                         r"int8, fp8, gguf, or None"):
        load_model(str(TINY), quantization="gptq")


@pytest.mark.parametrize("quant", [{"quant_method": "awq", "bits": 4}, {"quant_method": "fp8"},
                                   {"quant_method": "gptq"}])
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_checkpoint_stored_quantized_is_refused_not_read_as_floats(
        tmp_path: Path, quant: dict, quantization: str | None) -> None:
    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(ModelLoadError, match=rf"quant_method='{quant['quant_method']}'.*not "
                                             r"supported.*float checkpoint"):
        load_model(str(model), quantization=quantization)
