"""Penalties, logit_bias, allowed_token_ids and bad_words through the engine: greedy outputs
are those of vLLM's formulas applied by hand to the fake model's logits, step by step (so every
count, prompt token and bad-word prefix reached the device), the same with async scheduling,
through preemption and aborts; nothing compiles after warm-up; bad values name their field."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxengine.engine.args import EngineArgs
from jaxengine.model.fake import LOGIT, fake_greedy, fake_model, fake_next_token
from scheduler import SamplingParams, SamplingParamsError
from tests.engine_helpers import engine_over
from tests.jaxengine.engine.test_async_scheduling import both, run
from tests.jaxengine.engine.test_llm_engine import PROMPTS, FakeTokenizer, V, make_engine
from tests.jaxengine.sampling.penalty_reference import reference_logits

N = 12  # output tokens per request


def _text(ids: list[int]) -> str:
    return "".join(chr(0x100 + t) for t in ids)


def reference_greedy(prompt: list[int], sp: SamplingParams,
                     bad_words: tuple[tuple[int, ...], ...] = ()) -> list[int]:
    """The fake model's greedy output with vLLM's processing done in numpy at every step."""
    out: list[int] = []
    for _ in range(N):
        logits = np.zeros(V, np.float32)
        logits[fake_next_token(prompt + out, V)] = LOGIT
        out.append(int(np.argmax(reference_logits(logits, sp, prompt, out, bad_words))))
    return out


def _params() -> list[tuple[SamplingParams, tuple[tuple[int, ...], ...]]]:
    """Per prompt: parameters that change the greedy output, and the bad words as tokens."""
    g = [fake_greedy(p, N, V) for p in PROMPTS]
    base = dict(max_tokens=N, temperature=0.0, ignore_eos=True)
    return [
        (SamplingParams(**base, logit_bias={3: 9.5, g[0][1]: -1.0}, frequency_penalty=1.0,
                        repetition_penalty=1.5), ()),
        (SamplingParams(**base), ()),  # a plain row in the same batches
        (SamplingParams(**base, presence_penalty=2.0, logit_bias={0: 9.0, 1: 8.5}), ()),
        (SamplingParams(**base, allowed_token_ids=[2, 5, 7, 11, 13], frequency_penalty=0.5,
                        repetition_penalty=2.0), ()),
        (SamplingParams(**base, bad_words=[_text(g[4][:2]), _text(g[4][5:8]), _text([g[4][3]])]),
         (tuple(g[4][:2]), tuple(g[4][5:8]), (g[4][3],))),
        (SamplingParams(**base, repetition_penalty=0.5, logit_bias={7: 12.0}), ()),
        (SamplingParams(**base, frequency_penalty=-2.0, logit_bias={8: 9.9, g[6][0]: -0.5}),
         ()),
    ]


@pytest.mark.parametrize("kw", [{}, {"num_blocks": 18}, {"max_num_seqs": 2}],
                         ids=["roomy", "preempting", "two-seqs"])
def test_greedy_outputs_are_vllms_formulas_sync_and_async(kw: dict) -> None:
    rows = _params()
    out = both(PROMPTS, [sp for sp, _ in rows], **kw)  # asserts async == sync
    for i, (p, (sp, words)) in enumerate(zip(PROMPTS, rows, strict=True)):
        want = reference_greedy(p, sp, words)
        assert list(out[f"r{i}"][0]) == want, f"r{i}"
        if i != 1:  # every feature changed what the model alone would say
            assert want != fake_greedy(p, N, V), f"r{i}"
    if kw.get("num_blocks"):
        _, engine = run(PROMPTS, [sp for sp, _ in rows], async_scheduling=True, **kw)
        assert engine.state.stats.num_preemptions > 0


def test_seeded_sampling_with_penalties_is_the_same_async() -> None:
    params = [SamplingParams(max_tokens=N, temperature=4.0, seed=i, ignore_eos=True, logprobs=1,
                             presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2,
                             bad_words=[_text([5, 6])], logit_bias={9: 3.0})
              for i in range(len(PROMPTS))]
    penalized = both(PROMPTS, params)
    plain = both(PROMPTS, [SamplingParams(max_tokens=N, temperature=4.0, seed=i, ignore_eos=True)
                           for i in range(len(PROMPTS))])
    assert [v[0] for v in penalized.values()] != [v[0] for v in plain.values()]


def test_aborts_and_a_reused_id_keep_penalties_exact() -> None:
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={3: 9.5},
                        frequency_penalty=1.0, repetition_penalty=1.5)
    engine = make_engine(async_scheduling=True)
    engine.add_request("x", {"prompt_token_ids": [5, 6, 7]}, sp)
    engine.step()
    engine.step()  # x's first decode is in flight, its counts row holds its first token
    engine.abort_request("x")
    engine.add_request("x", {"prompt_token_ids": [40, 41, 42, 43]}, sp)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    got = list(outs[-1].outputs[0].token_ids)
    assert got == reference_greedy([40, 41, 42, 43], sp)[:6]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_nothing_compiles_after_warm_up_with_penalties_on_and_off(async_scheduling: bool) -> None:
    engine = make_engine(async_scheduling=async_scheduling, precompile=True,
                         debug_recompiles=True)
    rows = _params()
    for i, p in enumerate(PROMPTS * 2):  # batches with and without penalties, then mixed
        sp = rows[i % len(rows)][0] if i >= len(PROMPTS) // 2 else SamplingParams(max_tokens=4)
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    while engine.has_unfinished_requests():
        engine.step()  # debug_recompiles: a compilation here raises
    assert engine.runner.stats.compilations_after_warmup == 0



def test_a_slot_written_after_the_sampler_ran_compiles_nothing() -> None:
    # Weights committed to a device, as a loaded model's are: the sampler's outputs, and with
    # them the penalty tables, are committed too, and a jit entry lowered for unplaced shapes
    # misses them. A penalty request joining after a first step writes its slot into those
    # (a vocabulary of its own: no other test's writer is in jit's cache for these shapes).
    fake = fake_model.__wrapped__(83)
    model = dataclasses.replace(fake, params=jax.device_put(fake.params, jax.devices()[0]))
    engine = engine_over(model, EngineArgs(max_num_batched_tokens=8, max_num_seqs=2,
                                           block_size=4, precompile=True,
                                           debug_recompiles=True),
                         tokenizer=None, max_model_len=32, num_blocks=20)
    engine.add_request("plain", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=3))
    engine.step()
    assert engine.runner.penalties.tables.output_counts.committed  # the sampler's
    engine.add_request("penalized", {"prompt_token_ids": [3]},
                       SamplingParams(max_tokens=2, presence_penalty=1.0))
    while engine.has_unfinished_requests():
        engine.step()  # debug_recompiles: the slot writer compiling here would raise
    assert engine.runner.stats.compilations_after_warmup == 0


@pytest.mark.parametrize(("params", "field"), [
    (SamplingParams(logit_bias={V: 1.0}), "logit_bias"),
    (SamplingParams(allowed_token_ids=[1, V + 3]), "allowed_token_ids"),
    (SamplingParams(bad_words=["\u00fc"]), "bad_words"),  # no token of the fake vocabulary
])
def test_ids_outside_the_vocabulary_name_their_field(params: SamplingParams, field: str) -> None:
    engine = make_engine()
    with pytest.raises(SamplingParamsError) as info:
        engine.add_request("a", {"prompt_token_ids": [1, 2]}, params)
    assert info.value.param == field
    assert not engine.has_unfinished_requests()


def test_bad_words_need_a_tokenizer() -> None:
    engine = engine_over(fake_model(V), EngineArgs(max_num_batched_tokens=32, max_num_seqs=4,
                                                   block_size=4),
                         tokenizer=None, max_model_len=64, num_blocks=50)
    with pytest.raises(SamplingParamsError, match="tokenizer") as info:
        engine.add_request("a", [1, 2], SamplingParams(bad_words=["x"]))
    assert info.value.param == "bad_words"
    assert FakeTokenizer().encode(_text([4, 5]), add_special_tokens=False) == [4, 5]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_that_loses_its_slot_gets_exact_rows_back(async_scheduling: bool) -> None:
    """A slot is taken from a live request when preempted requests outnumber the slots; its
    rows are rebuilt from the host's outputs (plus, async, the token in flight on the device).
    Here the runner forgets the slot by hand, mid-decode, every other step."""
    rows = _params()
    engine = make_engine(async_scheduling=async_scheduling)
    for i in (0, 2, 3, 6):
        engine.add_request(f"r{i}", {"prompt_token_ids": PROMPTS[i]}, rows[i][0])
    outs, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps % 2 == 0:
            engine.runner.penalties.slots.release(["r0", "r3"])  # as an eviction does
        outs.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step()
                     if o.finished})
    for i in (0, 2, 3, 6):
        assert outs[f"r{i}"] == reference_greedy(PROMPTS[i], *rows[i]), f"r{i}"
