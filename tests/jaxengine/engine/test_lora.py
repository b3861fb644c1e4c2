"""Multi-LoRA through the engine against transformers + peft: the base model and three PEFT
adapters (tests/fixtures/lora/, made by tests/make_fixtures.py), their requests interleaved in
one `generate` with `max_loras=1` (the adapters take turns in the one device slot) and
`max_cpu_loras=2` (one is read again from its directory), give each its reference greedy
tokens and logprobs, and nothing compiles after warm-up while the slot changes hands."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxengine import LLM, LoRARequest
from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import model_fns
from jaxengine.loading.load import load_model
from jaxengine.model.fake import fake_model
from scheduler import SamplingParams
from tests.engine_helpers import engine_over

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
ADAPTERS = ("all7", "attn_rs", "mlp")
LOGPROB_TOL = 2e-3  # as the model's oracle test (tests/jaxengine/model/test_oracle.py)


@pytest.mark.parametrize("name", ["llama3_gqa", pytest.param("qwen2_bias_tied",
                                                            marks=pytest.mark.slow),
                                  pytest.param("gemma3_text", marks=pytest.mark.slow)])
def test_adapters_interleaved_with_one_slot_give_peft_greedy_tokens_and_logprobs(name):
    model, cfg, tokenizer = load_model(str(FIXTURES / "tiny" / name))
    fns = model_fns(model, cfg, attn_impl="reference", lora=True)
    args = EngineArgs(max_num_batched_tokens=4, max_num_seqs=4, block_size=4,
                      max_model_len=64, enable_lora=True, max_loras=1, max_cpu_loras=2,
                      max_lora_rank=8, debug_recompiles=True, precompile=True)
    llm = LLM.from_engine(engine_over(fns, args, tokenizer=tokenizer, max_model_len=64,
                                      num_blocks=80))
    base = np.load(FIXTURES / "lora" / name / "oracle.npz")
    oracles = {None: base} | {a: np.load(FIXTURES / "lora" / name / a / "oracle.npz")
                              for a in ADAPTERS}
    loras = {a: LoRARequest(a, i + 1, str(FIXTURES / "lora" / name / a))
             for i, a in enumerate(ADAPTERS)}
    which = [None, "all7", "attn_rs", "mlp", "all7", None, "mlp"]
    greedy = SamplingParams(max_tokens=len(base["greedy_ids"]), temperature=0.0,
                            ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": base["input_ids"].tolist()}] * len(which),
                        greedy, use_tqdm=False,
                        lora_request=[None if w is None else loras[w] for w in which])
    for w, out in zip(which, outs, strict=True):
        assert out.lora_request == (None if w is None else loras[w])
        got, want = out.outputs[0], oracles[w]
        assert list(got.token_ids) == want["greedy_ids"].tolist(), w
        logprobs = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids, strict=True)]
        np.testing.assert_allclose(logprobs, want["greedy_logprobs"], atol=LOGPROB_TOL, rtol=0)
    engine = llm.llm_engine
    assert len(engine.list_loras()) == 2  # max_cpu_loras: the third is read again when needed
    assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1
    assert engine.runner.stats.compilations_after_warmup == 0
    # vLLM's adapter calls on LLM: add reads into host memory, remove forgets (host and slot)
    held = llm.list_loras()
    assert llm.remove_lora(min(held)) and llm.list_loras() == held - {min(held)}
    assert not llm.remove_lora(99)
    assert llm.add_lora(loras["mlp"]) and 3 in llm.list_loras()


def test_a_lora_request_needs_enable_lora():
    engine = engine_over(fake_model(64), EngineArgs(max_num_batched_tokens=16, max_num_seqs=2,
                                                    block_size=4),
                         tokenizer=None, max_model_len=32, num_blocks=20)
    with pytest.raises(ValueError, match="enable_lora"):
        engine.add_request("a", {"prompt_token_ids": [1, 2]},
                           lora_request=LoRARequest("x", 1, "/nowhere"))
    with pytest.raises(ValueError, match="enable_lora"):
        engine.list_loras()
    assert not engine.has_unfinished_requests()


def test_an_adapter_that_cannot_be_served_is_refused_and_the_engine_goes_on():
    model, cfg, tokenizer = load_model(str(FIXTURES / "tiny" / "llama3_gqa"))
    fns = model_fns(model, cfg, attn_impl="reference", lora=True)
    args = EngineArgs(max_num_batched_tokens=4, max_num_seqs=4, block_size=4,
                      max_model_len=64, enable_lora=True, max_lora_rank=8)
    engine = engine_over(fns, args, tokenizer=tokenizer, max_model_len=64, num_blocks=40)
    other_base = LoRARequest("g", 1, str(FIXTURES / "lora" / "gemma3_text" / "all7"))
    with pytest.raises(ValueError, match="another base model"):
        engine.add_request("a", {"prompt_token_ids": [1, 2]}, lora_request=other_base)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        engine.add_lora(LoRARequest("none", 2, str(FIXTURES / "lora")))
    assert not engine.has_unfinished_requests() and engine.list_loras() == set()
    assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1
