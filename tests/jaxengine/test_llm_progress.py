"""`LLM()` shows its progress: a bar while the weights load (on a terminal) and one while the
buckets a first request needs compile (on by default; the rest follow in the background), after
which `generate` compiles nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxengine.llm import LLM
from jaxengine.loading.load import load_model
from scheduler import SamplingParams

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "llama_tied_mha"
SMALL = dict(max_num_batched_tokens=32, max_num_seqs=4, block_size=4, max_model_len=64,
             num_gpu_blocks_override=64, skip_tokenizer_init=True)
# One short prompt, one that is prefilled in two chunks, and a third: every bucket of SMALL.
PROMPTS = [{"prompt_token_ids": [5]}, {"prompt_token_ids": list(range(1, 41))},
           {"prompt_token_ids": [9, 8, 7]}]
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def test_llm_compiles_every_bucket_with_a_bar_then_generate_compiles_nothing(
        capsys: pytest.CaptureFixture[str]) -> None:
    llm = LLM(str(TINY), debug_recompiles=True, **SMALL)
    runner = llm.llm_engine.runner
    bar = capsys.readouterr().err
    # Ready once a first short request can run: the smallest step and sampler are made under
    # the bar, the other buckets on a background thread, which steps needing them wait for.
    assert runner.warm and "precompile" in bar and "2/2" in bar
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)  # debug_recompiles: would raise
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5, 5]
    assert runner.stats.compilations_after_warmup == 0
    runner.wait_for_programs()  # the buckets no step needed may still be in the background
    # each once; the slot writer may have been compiled by an earlier runner of these shapes
    assert runner.num_programs - 1 <= runner.stats.compilations <= runner.num_programs


def test_precompile_false_leaves_compiling_to_the_first_steps(
        capsys: pytest.CaptureFixture[str]) -> None:
    llm = LLM(str(TINY), precompile=False, **SMALL)
    runner = llm.llm_engine.runner
    assert not runner.warm and "precompile" not in capsys.readouterr().err
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5, 5]
    assert runner.stats.compilations > 0


def test_loading_draws_a_bar_over_the_tensors_only_when_asked_or_on_a_terminal(
        capsys: pytest.CaptureFixture[str]) -> None:
    load_model(str(TINY), with_tokenizer=False, progress=True)
    bar = capsys.readouterr().err
    # The tiny checkpoint: embedding, final norm and 9 tensors in each of its 3 layers (tied).
    assert "loading weights" in bar and "29/29" in bar
    load_model(str(TINY), with_tokenizer=False)  # None: pytest's stderr is no terminal
    assert "loading weights" not in capsys.readouterr().err
