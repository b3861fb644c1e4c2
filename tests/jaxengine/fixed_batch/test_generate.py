"""`jaxengine.generate`: jit-compiled fixed-batch generation inside an outer `jax.jit`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import chex
import jax
import numpy as np
import pytest

from jaxengine.fixed_batch.generate import generate
from jaxengine.model.fake import LOGIT, fake_greedy, fake_model
from jaxengine.runner.compiles import compile_count, ensure_listener
from scheduler import SamplingParams

V = 97
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42], [3, 1, 4, 1, 5]]
TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny" / "llama_tied_mha"


def _left_pad(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    S = max(map(len, prompts))
    ids = np.zeros((len(prompts), S), np.int32)
    for b, p in enumerate(prompts):
        ids[b, S - len(p):] = p
    return ids, np.asarray([len(p) for p in prompts], np.int32)


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_greedy_under_an_outer_jit_equals_single_request_greedy(cache: str) -> None:
    model = fake_model(V)
    ids, lens = _left_pad(PROMPTS)

    @jax.jit
    def research_program(params: dict, ids: jax.Array, lens: jax.Array) -> jax.Array:
        out = generate(model, ids, lens, max_new_tokens=6, params=params, cache=cache,
                       block_size=4)
        return out.tokens

    tokens = np.asarray(research_program(model.params, ids, lens))
    expected = np.asarray([fake_greedy(p, 6, V) for p in PROMPTS], np.int32)  # i32[B, 6]
    chex.assert_trees_all_equal(tokens, expected, strict=True)  # values, shape and dtype


def test_decoding_is_one_loop_not_unrolled() -> None:
    """The decode steps are a `lax.while_loop`: however many tokens, the model step and the
    logits are traced twice each (prefill, then the loop body), never once per token."""
    fake = fake_model(V)
    model = dataclasses.replace(fake, step=chex.assert_max_traces(fake.step, n=2),
                                compute_logits=chex.assert_max_traces(fake.compute_logits, n=2))
    ids, lens = _left_pad(PROMPTS)
    out = jax.jit(lambda i, n: generate(model, i, n, max_new_tokens=20, block_size=4))(ids, lens)
    want = np.asarray([fake_greedy(p, 20, V) for p in PROMPTS], np.int32)  # i32[B, 20]
    chex.assert_trees_all_equal((out.tokens, out.lengths),
                                (want, np.full(len(PROMPTS), 20, np.int32)), strict=True)


def test_eos_stops_a_row_and_pads_it() -> None:
    model = fake_model(V)
    ids, lens = _left_pad(PROMPTS)
    eos = fake_greedy(PROMPTS[0], 6, V)[2]  # row 0's third token
    out = jax.jit(lambda i, n: generate(model, i, n, max_new_tokens=6, eos_token_id=eos,
                                        pad_id=-1, block_size=4))(ids, lens)
    row = np.asarray(out.tokens[0]).tolist()
    first = fake_greedy(PROMPTS[0], 6, V).index(eos)
    assert row[: first + 1] == fake_greedy(PROMPTS[0], first + 1, V)
    assert row[first + 1:] == [-1] * (5 - first)
    assert int(out.lengths[0]) == first + 1


def test_the_models_eos_ids_stop_by_default_and_an_empty_tuple_never_stops() -> None:
    """`eos_token_id=None` is `ModelFns.eos_token_ids` (the tokenizer's for a real model);
    `()` runs every row to `max_new_tokens`, as `ignore_eos=True` does."""
    ids, lens = _left_pad(PROMPTS)
    want = [fake_greedy(p, 7, V) for p in PROMPTS]
    eos = (want[0][1], want[2][3])
    model = dataclasses.replace(fake_model(V), eos_token_ids=eos)
    by_default = generate(model, ids, lens, max_new_tokens=7, block_size=4)
    named = generate(model, ids, lens, max_new_tokens=7, block_size=4, eos_token_id=eos)
    chex.assert_trees_all_equal(by_default, named)
    assert int(by_default.lengths[0]) == 2  # stopped: the default is not "never"
    never = generate(model, ids, lens, max_new_tokens=7, block_size=4, eos_token_id=())
    chex.assert_trees_all_equal((never.tokens, never.lengths),
                                (np.asarray(want, np.int32), np.full(len(PROMPTS), 7, np.int32)))


def test_sampling_is_seeded() -> None:
    model = fake_model(V)
    ids, lens = _left_pad(PROMPTS)
    run = jax.jit(lambda key: generate(model, ids, lens, max_new_tokens=5, key=key,
                                       temperature=50.0, block_size=4).tokens)
    a, b = run(jax.random.key(0)), run(jax.random.key(0))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, run(jax.random.key(1)))


def test_logprobs_of_the_fake_model_by_hand() -> None:
    """The fake model puts LOGIT on its next token and 0 elsewhere, so every greedy token's raw
    logprob is LOGIT - log(e^LOGIT + V - 1), and the best of the rest is -log(e^LOGIT + V - 1)."""
    model = fake_model(V)
    ids, lens = _left_pad(PROMPTS)
    out = generate(model, ids, lens, max_new_tokens=4, logprobs=2, block_size=4)
    norm = np.log(np.exp(LOGIT) + V - 1)
    close = dict(rtol=0, atol=1e-6)  # f32 rounding of a log-softmax over logits of 10
    np.testing.assert_allclose(out.logprobs, np.full((4, 4), LOGIT - norm), **close)
    np.testing.assert_allclose(out.top_logprobs[..., 0], out.logprobs, **close)
    np.testing.assert_allclose(out.top_logprobs[..., 1], np.full((4, 4), -norm), **close)
    np.testing.assert_array_equal(out.top_token_ids[..., 0], out.tokens)
    assert out.top_logprobs.shape == (4, 4, 2) and out.top_token_ids.dtype == np.int32


def test_stopped_rows_have_no_logprobs_and_any_eos_id_stops() -> None:
    model = fake_model(V)
    ids, lens = _left_pad(PROMPTS)
    want = [fake_greedy(p, 6, V) for p in PROMPTS]
    eos = [want[0][1], want[2][3]]  # row 0 stops after 2 tokens, row 2 after 4 (or earlier)
    out = generate(model, ids, lens, max_new_tokens=6, logprobs=1, eos_token_id=eos, pad_id=-1,
                   block_size=4)
    for b, row in enumerate(want):
        n = next((i + 1 for i, t in enumerate(row) if t in eos), 6)
        assert int(out.lengths[b]) == n
        assert np.asarray(out.tokens[b]).tolist() == row[:n] + [-1] * (6 - n)
        assert np.all(np.asarray(out.logprobs[b, :n]) < 0)
        assert np.all(np.asarray(out.logprobs[b, n:]) == 0)
        assert np.all(np.asarray(out.top_token_ids[b, n:]) == -1)


def test_retrace_rules_by_the_compile_counter() -> None:
    """Values (prompts of one shape, temperature, key, an EOS id, none or the model's one,
    the weights of a copy of the model) reuse the program; a new max_new_tokens or batch shape
    compiles a new one."""
    ensure_listener()
    model = dataclasses.replace(fake_model(V), eos_token_ids=(4,))
    ids, lens = _left_pad(PROMPTS)
    count = lambda: compile_count("jaxengine_generate")  # noqa: E731
    run = lambda i, n, **kw: generate(model, i, n, block_size=4, **kw).tokens.block_until_ready()  # noqa: E731
    run(ids, lens, max_new_tokens=5, eos_token_id=None)
    first = count()
    other = (ids + 1) % V
    run(other, np.asarray([9, 2, 5, 1], np.int32), max_new_tokens=5, temperature=0.7,
        key=jax.random.key(3), eos_token_id=4)
    run(ids, lens, max_new_tokens=5, temperature=np.asarray([0.0, 1.0, 2.0, 0.5], np.float32),
        top_k=3, top_p=0.9, eos_token_id=7, pad_id=5)
    run(ids, lens, max_new_tokens=5, eos_token_id=())
    new_weights = dataclasses.replace(model, params={"logit": np.float32(3.0)})
    generate(new_weights, ids, lens, block_size=4, max_new_tokens=5).tokens.block_until_ready()
    assert count() == first
    run(ids, lens, max_new_tokens=6)
    assert count() == first + 1
    run(ids[:2], lens[:2], max_new_tokens=6)
    assert count() == first + 2


@pytest.mark.parametrize("bad, match", [
    (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
    (dict(max_new_tokens=3, logprobs=-1), "logprobs must be an int >= 0"),
    (dict(max_new_tokens=3, cache="ring"), "cache must be"),
    (dict(max_new_tokens=3, prompt_lens=np.asarray([3, 9, 0, 5])), r"lengths must be in \[1, 9\]"),
    (dict(max_new_tokens=3, prompt_ids=np.asarray([1, 2, 3])), "must be 2-D"),
    (dict(max_new_tokens=3, prompt_ids=np.full((4, 9), V)), r"token ids in \[0, 97\)"),
])
def test_bad_arguments_say_what_to_change(bad: dict, match: str) -> None:
    ids, lens = _left_pad(PROMPTS)
    kw = dict(prompt_ids=ids, prompt_lens=lens) | bad
    with pytest.raises(ValueError, match=match):
        generate(fake_model(V), kw.pop("prompt_ids"), kw.pop("prompt_lens"), **kw)


def test_real_tiny_model_matches_the_engine_tokens_logprobs_and_text() -> None:
    """Greedy tokens, raw logprobs (sampled and top 3) and text equal `LLM.generate`'s with
    SamplingParams(logprobs=3), over the LLM's own model (`model_fns_of`) and over one loaded
    alone (`load_model_fns`), both stopping on the tokenizer's EOS ids by default."""
    from jaxengine import LLM, decode_batch, encode_batch, load_model_fns, model_fns_of

    llm = LLM(str(TINY), max_num_batched_tokens=32, max_num_seqs=4, block_size=4,
              max_model_len=64, num_gpu_blocks_override=64, precompile=False)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
    texts = ["Hello", "The quick brown fox", "ab"]
    ref = llm.generate(texts, params, use_tqdm=False)
    shared, tokenizer = model_fns_of(llm)
    alone, _ = load_model_fns(str(TINY), attention_backend="reference")
    ids, lens = encode_batch(tokenizer, texts)
    for fns in (shared, alone):
        assert fns.eos_token_ids == tokenizer.eos_token_ids
        out = jax.jit(lambda p, i, n, fns=fns: generate(
            fns, i, n, max_new_tokens=6, params=p, cache="paged", block_size=4,
            logprobs=3))(fns.params, ids, lens)
        assert decode_batch(tokenizer, out) == [o.outputs[0].text for o in ref]
        for b, o in enumerate(ref):
            c = o.outputs[0]
            n = len(c.token_ids)
            assert int(out.lengths[b]) == n
            assert np.asarray(out.tokens[b, :n]).tolist() == list(c.token_ids)
            sampled = [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
            np.testing.assert_allclose(out.logprobs[b, :n], sampled, rtol=1e-5, atol=1e-5)
            for i, entry in enumerate(c.logprobs):
                top = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank)
                assert np.asarray(out.top_token_ids[b, i]).tolist() == [t for _, t, _ in top]
                np.testing.assert_allclose(out.top_logprobs[b, i], [lp for *_, lp in top],
                                           rtol=1e-5, atol=1e-5)
