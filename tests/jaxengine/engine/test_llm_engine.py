"""The engine loop over the fake model: batching, preemption and prefix caching change nothing."""

from __future__ import annotations

from typing import Any

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.llm import LLM
from jaxengine.loading.tokenizer import Tokenizer
from jaxengine.model.fake import fake_greedy, fake_model
from scheduler import SamplingParams, check_invariants
from tests.engine_helpers import engine_over
from tests.fixtures.char_tokenizer import char_tokenizer

V = 97
EOS = 96


class FakeTokenizer(Tokenizer):
    """A real tokenizer where token t is the character U+0100 + t (one character per token,
    all printable); EOS is a special token."""

    def __init__(self) -> None:
        chars = char_tokenizer([chr(0x100 + t) for t in range(V)], eos=chr(0x100 + EOS))
        super().__init__(chars.backend, eos_token_ids=chars.eos_token_ids)


def make_engine(*, num_blocks: int = 200, max_model_len: int = 256, **kw: Any) -> LLMEngine:
    """An engine over the fake model and tokenizer, with small default sizes."""
    base: dict[str, Any] = dict(max_num_batched_tokens=32, max_num_seqs=4, block_size=4)
    base.update(kw)
    return engine_over(fake_model(V), EngineArgs(**base), tokenizer=FakeTokenizer(),
                       max_model_len=max_model_len, num_blocks=num_blocks)


def run_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
            ) -> dict[str, Any]:
    """Add every prompt, step to the end checking invariants; finished outputs by id."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        check_invariants(engine.state)
    assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1
    return done


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(1, 42)), [9] * 13, list(range(40, 47)), [3, 1, 4, 1, 5, 9],
           list(range(10, 30)), [2] * 3]


def test_batched_greedy_equals_single_request_greedy() -> None:
    done = run_all(make_engine(), PROMPTS, GREEDY)
    for i, p in enumerate(PROMPTS):
        out = done[f"r{i}"].outputs[0]
        assert list(out.token_ids) == fake_greedy(p, 12, V)
        assert out.finish_reason == "length"
        assert out.text == FakeTokenizer().decode(out.token_ids)


def test_preemption_gives_the_same_outputs_as_an_ample_pool() -> None:
    ample = run_all(make_engine(), PROMPTS, GREEDY)
    tight_engine = make_engine(num_blocks=18)
    tight = run_all(tight_engine, PROMPTS, GREEDY)
    assert tight_engine.state.stats.num_preemptions > 0
    assert {r: o.outputs[0].token_ids for r, o in tight.items()} == {
        r: o.outputs[0].token_ids for r, o in ample.items()}


def test_prefix_caching_on_and_off_agree_and_hits_are_counted() -> None:
    shared = list(range(50, 82))  # 8 full blocks of 4
    prompts = [shared + [i, i + 1, i + 2] for i in range(5)]
    results = {}
    for caching in (True, False):
        engine = make_engine(enable_prefix_caching=caching, max_num_seqs=2)
        results[caching] = run_all(engine, prompts, GREEDY)
        hits = engine.state.stats.prefix_cache_hits
        assert (hits > 0) == caching
    for r, out in results[True].items():
        assert out.outputs[0].token_ids == results[False][r].outputs[0].token_ids
    assert max(o.num_cached_tokens for o in results[True].values()) == 32


def test_unchunked_prefill_and_long_prefill_threshold_agree() -> None:
    ample = run_all(make_engine(), PROMPTS, GREEDY)
    for kw in (dict(enable_chunked_prefill=False, max_num_batched_tokens=64),
               dict(long_prefill_token_threshold=8)):
        out = run_all(make_engine(max_model_len=64, **kw), PROMPTS, GREEDY)
        assert {r: o.outputs[0].token_ids for r, o in out.items()} == {
            r: o.outputs[0].token_ids for r, o in ample.items()}


def test_precompiled_engine_compiles_nothing_on_a_mixed_workload() -> None:
    engine = make_engine(precompile=True, debug_recompiles=True)
    sampled = SamplingParams(max_tokens=7, temperature=0.8, top_p=0.9, top_k=5, logprobs=2)
    run_all(engine, PROMPTS, GREEDY)
    run_all(engine, PROMPTS[:3], sampled)
    assert engine.runner.stats.compilations_after_warmup == 0


def test_same_seed_same_tokens_whatever_the_batch_mates() -> None:
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=42, ignore_eos=True)
    alone = run_all(make_engine(), [PROMPTS[0]], seeded)["r0"].outputs[0].token_ids
    crowd = run_all(make_engine(), PROMPTS, seeded)["r0"].outputs[0].token_ids
    tight = run_all(make_engine(num_blocks=18), PROMPTS, seeded)["r0"].outputs[0].token_ids
    assert alone == crowd == tight


def test_unseeded_requests_follow_the_engine_seed() -> None:
    params = SamplingParams(max_tokens=8, temperature=50.0, ignore_eos=True)

    def tokens(seed: int) -> dict[str, tuple[int, ...]]:
        done = run_all(make_engine(seed=seed), PROMPTS[:2], params)
        return {r: o.outputs[0].token_ids for r, o in done.items()}

    assert tokens(1) == tokens(1) != tokens(2)


def test_llm_generate_keeps_input_order_and_fills_metrics() -> None:
    llm = LLM.from_engine(make_engine())
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == PROMPTS[:4]
    for o, p in zip(outs, PROMPTS, strict=False):
        assert list(o.outputs[0].token_ids) == fake_greedy(p, 12, V)
        m = o.metrics
        assert o.finished and m.ttft is not None and m.tpot is not None and m.ttft >= 0
        assert m.first_scheduled_time is not None and m.finished_time >= m.first_token_time
    text = FakeTokenizer().decode(PROMPTS[0])
    assert llm.generate(text, GREEDY, use_tqdm=False)[0].prompt == text


def test_the_models_other_eos_ids_stop_a_request_unless_ignore_eos() -> None:
    """A generation_config's extra EOS ids stop requests as stop tokens, as in vLLM."""
    prompt = [5, 6, 7]
    third = fake_greedy(prompt, 12, V)[2]
    tokenizer = FakeTokenizer()
    tokenizer.eos_token_ids = (EOS, third)
    done = {}
    for ignore in (False, True):
        engine = engine_over(fake_model(V), EngineArgs(max_num_batched_tokens=32, max_num_seqs=4,
                                                       block_size=4),
                             tokenizer=tokenizer, max_model_len=256, num_blocks=200)
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=ignore)
        done[ignore] = run_all(engine, [prompt], params)["r0"].outputs[0]
    stopped = done[False]
    assert list(stopped.token_ids) == fake_greedy(prompt, 3, V)
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", third)
    assert len(done[True].token_ids) == 12 and done[True].finish_reason == "length"
