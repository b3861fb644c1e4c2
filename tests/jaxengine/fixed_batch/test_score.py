"""`jaxengine.score`: continuation log-likelihoods, against the fake model by hand, a tiny real
model's own greedy generation, and one unpadded row at a time."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from jaxengine import encode_batch, generate, load_model_fns, score
from jaxengine.model.fake import LOGIT, fake_greedy, fake_model

V = 97
TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny" / "llama_tied_mha"
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42]]


def test_fake_model_by_hand() -> None:
    """Its next token has logit LOGIT, every other 0: a greedy continuation scores
    LOGIT - log(e^LOGIT + V - 1) per token, a wrong token -log(e^LOGIT + V - 1)."""
    model = fake_model(V)
    ids, lens = encode_batch(None, PROMPTS)
    cont = np.asarray([fake_greedy(p, 4, V) for p in PROMPTS], np.int32)  # i32[3, 4]
    cont[1, 2] = (cont[1, 2] + 1) % V  # row 1 goes wrong at its third token
    clens = np.asarray([4, 4, 2], np.int32)  # row 2 scores two tokens only
    out = score(model, ids, cont, lens, clens, block_size=4)
    norm = np.log(np.exp(LOGIT) + V - 1)
    want = np.full((3, 4), LOGIT - norm)
    want[1, 2], want[1, 3], want[2, 2:] = -norm, np.nan, 0.0
    close = dict(rtol=0, atol=1e-5)  # f32 rounding of a log-softmax over logits of 10
    np.testing.assert_allclose(out.logprobs[0], want[0], **close)
    np.testing.assert_allclose(out.logprobs[1, :3], want[1, :3], **close)
    np.testing.assert_allclose(out.logprobs[2], want[2], **close)
    np.testing.assert_allclose(out.total, np.asarray(out.logprobs).sum(axis=1), rtol=1e-6)
    assert np.asarray(out.is_greedy).tolist() == [True, False, True]


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_tiny_model_scores_its_greedy_output_with_generates_logprobs(cache: str) -> None:
    """Scoring what greedy `generate` produced (decode steps over the cache) gives the logprobs
    `generate` reported, from one prefill over prompt and continuation, under an outer jit."""
    fns, tokenizer = load_model_fns(str(TINY), attention_backend="reference")
    ids, lens = encode_batch(tokenizer, ["Hello", "The quick brown fox", "ab"])
    gen = generate(fns, ids, lens, max_new_tokens=5, block_size=4)

    @jax.jit
    def research(params, ids, lens, cont):
        return score(fns, ids, cont, lens, params=params, cache=cache, block_size=4)

    out = research(fns.params, ids, lens, gen.tokens)
    np.testing.assert_allclose(out.logprobs, gen.logprobs, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out.total, np.asarray(gen.logprobs).sum(axis=1), rtol=1e-4)
    assert np.asarray(out.is_greedy).all()


def test_padding_does_not_change_a_rows_score() -> None:
    """A row scored in a padded batch (prompt padded left, continuation right) equals the row
    scored alone without padding."""
    fns, _ = load_model_fns(str(TINY), attention_backend="reference")
    prompts, conts = [[7, 8, 9, 10, 11], [3, 4]], [[20, 21, 22], [30]]
    ids, lens = encode_batch(None, prompts)
    cont = np.asarray([[20, 21, 22], [30, 0, 0]], np.int32)
    batch = score(fns, ids, cont, lens, np.asarray([3, 1], np.int32), block_size=4)
    for b, (p, c) in enumerate(zip(prompts, conts, strict=True)):
        alone = score(fns, np.asarray([p]), np.asarray([c]), block_size=4)
        np.testing.assert_allclose(batch.logprobs[b, :len(c)], alone.logprobs[0], rtol=1e-4,
                                   atol=1e-5)
        np.testing.assert_allclose(batch.total[b], alone.total[0], rtol=1e-4)
    assert np.all(np.asarray(batch.logprobs[1, 1:]) == 0)


def test_bad_arguments_say_what_to_change() -> None:
    model = fake_model(V)
    ids, lens = encode_batch(None, PROMPTS)
    with pytest.raises(ValueError, match="3 rows but continuation_ids has 2"):
        score(model, ids, np.ones((2, 4), np.int32), lens)
    with pytest.raises(ValueError, match=r"continuation_ids lengths must be in \[1, 4\]"):
        score(model, ids, np.ones((3, 4), np.int32), lens, np.asarray([1, 5, 2]))


@pytest.mark.parametrize("name", ["gemma2_softcap", "gemma3_text", "mixtral_moe", "qwen3_moe"])
def test_new_families_generate_and_score_transformers_tokens(name: str) -> None:
    """`generate` and `score` (the research API, one program each) on the families with
    windows, soft-caps and experts: transformers' greedy tokens and their logprobs."""
    path = TINY.parent / name
    oracle = np.load(path / "oracle.npz")
    fns, _ = load_model_fns(str(path))
    ids = oracle["input_ids"][None, :]
    want = oracle["greedy_ids"][None, :]
    gen = generate(fns, ids, max_new_tokens=want.shape[1], block_size=4)
    assert np.asarray(gen.tokens).tolist() == want.tolist()
    np.testing.assert_allclose(gen.logprobs[0], oracle["greedy_logprobs"], atol=2e-3, rtol=0)
    out = score(fns, ids, want, cache="paged", block_size=4)
    np.testing.assert_allclose(out.logprobs[0], oracle["greedy_logprobs"], atol=2e-3, rtol=0)
    assert bool(out.is_greedy[0])
