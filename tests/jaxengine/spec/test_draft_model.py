"""`"method": "draft_model"` on tiny random Llamas: outputs are those without speculation;
with the target itself as the draft every greedy draft is accepted (its KV, replayed each step
and extended by the proposal steps, is exactly the target's), through preemption too; the draft's
programs compile only in warm-up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
import pytest

from jaxengine.config import SpeculativeConfig
from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import build_engine, load_draft
from jaxengine.model.fake import fake_model
from jaxengine.runner.compiles import compile_count
from jaxengine.spec.draft_model import PROPOSE_NAME, REPLAY_NAME
from scheduler import PLACEHOLDER_TOKEN_ID, SamplingParams, check_invariants
from tests.engine_helpers import engine_over
from tests.jaxengine.engine.test_llm_engine import V
from tests.jaxengine.spec.test_spec_engine import LOOPS, Counts

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny"
TARGET = TINY / "llama3_gqa"
PROMPTS = ["abcabcabcabc", "hello hello hello", "xyz", "1 2 3 1 2 3 1 2"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# A 16-token budget (4 rows of k + 1 = 4 tokens): token buckets 1..16, so the draft's replay,
# which compiles for every bucket, compiles 5 programs, not 7 of up to 64 tokens.
SMALL_BUDGET = dict(max_num_batched_tokens=16)


def draft_config(model: Path, k: int = 3) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


def run(params: SamplingParams, **kw: Any) -> tuple[dict[str, tuple], Counts]:
    """Every prompt to the end; outputs, and the drafts counted (with `late`: the draft's
    compilations after the engine was built, and `preempted`)."""
    args = dict(model=str(TARGET), max_model_len=128, max_num_batched_tokens=64,
                max_num_seqs=4, block_size=4, num_gpu_blocks_override=200,
                attention_backend="reference")
    engine = build_engine(EngineArgs(**{**args, **kw}))
    built = compile_count(REPLAY_NAME, PROPOSE_NAME)
    counts = Counts()
    engine.stat_loggers.append(counts)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (tuple(out.outputs[0].token_ids), out.outputs[0].text)
        check_invariants(engine.state)
    assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1
    counts.late = compile_count(REPLAY_NAME, PROPOSE_NAME) - built  # type: ignore[attr-defined]
    counts.preempted = engine.state.stats.num_preemptions  # type: ignore[attr-defined]
    counts.kv_dtypes = {engine.runner.kv.dtype,  # type: ignore[attr-defined]
                        getattr(engine.speculator, "kv", engine.runner.kv).dtype}
    return done, counts


@pytest.fixture(scope="module")
def plain() -> dict[str, tuple]:
    """The prompts' GREEDY outputs without speculation, synchronous, on the small budget."""
    return run(GREEDY, async_scheduling=False, **SMALL_BUDGET)[0]


# The synchronous case runs with -m slow: the draft's programs are precompiled the same way
# under either loop (the async case checks that here), and the fp8 test below drafts
# synchronously with every draft right. (Precompiling the fp8 engine instead costs ~60 s.)
@pytest.mark.parametrize("async_scheduling", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["sync", "async"])
def test_the_target_as_its_own_draft_is_always_right_and_compiles_only_in_warm_up(
        plain: dict[str, tuple], async_scheduling: bool) -> None:
    """Under async scheduling too: the replay reads the placeholders from the history, and a
    proposal behind a decode in flight (k + 1 steps, its first dropped) guesses it right."""
    before = compile_count(REPLAY_NAME, PROPOSE_NAME)
    spec, counts = run(GREEDY, speculative_config=draft_config(TARGET), precompile=True,
                       debug_recompiles=True,  # the target's programs: none after warm-up
                       async_scheduling=async_scheduling, **SMALL_BUDGET)
    assert spec == plain
    assert counts.accepted == counts.draft_tokens > 0
    assert compile_count(REPLAY_NAME, PROPOSE_NAME) > before  # precompile made the draft's,
    assert counts.late == 0  # type: ignore[attr-defined]  # and the steps needed no other


def test_an_fp8_cache_in_target_and_draft_keeps_every_draft_right() -> None:
    """The draft's cache takes the target's dtype: the target as its own draft still proposes
    exactly what it will accept."""
    plain, counts = run(GREEDY, kv_cache_dtype="fp8", **SMALL_BUDGET)
    fp8_bits = {jnp.dtype(jnp.uint8)}  # float8_e4m3fn's bits, on the CPU path
    assert counts.kv_dtypes == fp8_bits  # type: ignore[attr-defined]
    spec, counts = run(GREEDY, kv_cache_dtype="fp8", speculative_config=draft_config(TARGET),
                       **SMALL_BUDGET)
    assert counts.kv_dtypes == fp8_bits  # type: ignore[attr-defined]
    assert spec == plain
    assert counts.accepted == counts.draft_tokens > 0


@pytest.mark.slow  # 22 s: two engines recomputing preempted requests
@LOOPS
def test_replay_survives_preemption(async_scheduling: bool) -> None:
    tight = dict(num_gpu_blocks_override=24, max_model_len=64)  # 4 requests need 44 blocks
    plain, _ = run(GREEDY, **tight)
    spec, counts = run(GREEDY, **tight, speculative_config=draft_config(TARGET, k=2),
                       async_scheduling=async_scheduling)
    assert counts.preempted > 0  # type: ignore[attr-defined]
    assert spec == plain
    assert counts.accepted == counts.draft_tokens > 0


@pytest.mark.slow  # 42 s: two engines; the target-as-its-own-draft test covers drafting
def test_another_draft_changes_no_output() -> None:
    plain, _ = run(GREEDY)
    spec, counts = run(GREEDY, speculative_config=draft_config(TINY / "llama_tied_mha"))
    assert spec == plain
    assert counts.draft_tokens > 0
    seeded = SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    assert run(seeded, speculative_config=draft_config(TARGET))[0] == run(seeded)[0]


def test_bad_draft_models_are_named() -> None:
    with pytest.raises(ValueError, match="model .* is required by method 'draft_model'"):
        EngineArgs(speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    args = EngineArgs(max_num_batched_tokens=32, max_num_seqs=4, block_size=4,
                      speculative_config=draft_config(TARGET))
    draft = load_draft(SpeculativeConfig.from_dict(draft_config(TARGET)), dtype="float32",
                       attention="reference")
    with pytest.raises(ValueError, match="draft model's vocabulary \\(128\\) must be the "
                                         "target's \\(97\\)"):
        engine_over(fake_model(V), args, tokenizer=None, max_model_len=64, num_blocks=50,
                    draft=draft)
    with pytest.raises(ValueError, match="method 'draft_model' needs the draft model's"):
        engine_over(fake_model(V), args, tokenizer=None, max_model_len=64, num_blocks=50)
    with pytest.raises(ValueError, match="no_such_model"):
        load_draft(SpeculativeConfig.from_dict(draft_config(TINY / "no_such_model")),
                   dtype="float32", attention=None)


@pytest.mark.slow  # 21 s: two engines, the draft's replay and proposal
def test_an_id_reused_while_its_old_step_is_in_flight() -> None:
    """Async scheduling: "r0" is aborted while the step in flight decodes it from a
    placeholder, and a new, shorter "r0" arrives before that step is collected. The draft's
    replay of that step must not read the placeholder from the new request's history."""
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = build_engine(EngineArgs(
        model=str(TARGET), max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4,
        block_size=4, num_gpu_blocks_override=200, attention_backend="reference",
        speculative_config=draft_config(TARGET)))
    counts = Counts()
    engine.stat_loggers.append(counts)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    for _ in range(40):
        engine.step()
        plan = engine._loop.plan
        if plan is not None and PLACEHOLDER_TOKEN_ID in plan.input_token_ids.get("r0", ()):
            break
    else:
        raise AssertionError("r0 was never decoded from a placeholder")
    engine.abort_request("r0")
    engine.add_request("r0", "x", short)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = tuple(out.outputs[0].token_ids)
    check_invariants(engine.state)
    assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1
    plain = build_engine(EngineArgs(
        model=str(TARGET), max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4,
        block_size=4, num_gpu_blocks_override=200, attention_backend="reference"))
    plain.add_request("r0", "x", short)
    while plain.has_unfinished_requests():
        for out in plain.step():
            if out.finished:
                assert done["r0"] == tuple(out.outputs[0].token_ids)
    assert counts.accepted == counts.draft_tokens > 0
