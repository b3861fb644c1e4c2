"""Device sampling: filters never leak, seeds repeat, greedy is argmax, logprobs are exact."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.sampling.sampler import SamplerOutput, SamplingMetadata, sample_impl

R = 512  # draws per call: one logits row replicated, each with its own output position

# The runner traces sample_impl inside its own jitted sampler; here it is jitted alone.
_jitted_sample = jax.jit(sample_impl, static_argnames=("max_logprobs",))


def sample(logits: np.ndarray, md: SamplingMetadata, *, max_logprobs: int = 0) -> SamplerOutput:
    return _jitted_sample(logits, md, max_logprobs=max_logprobs)


def _md(n: int, **overrides: object) -> SamplingMetadata:
    base = dict(
        temperature=np.ones(n, np.float32),
        top_k=np.zeros(n, np.int32),
        top_p=np.ones(n, np.float32),
        min_p=np.zeros(n, np.float32),
        seeds=np.full(n, 1234, np.uint32),
        positions=np.arange(n, dtype=np.int32),
        num_logprobs=np.full(n, -1, np.int32),
        banned_token_ids=np.full((n, 2), -1, np.int32),
    )
    for name, value in overrides.items():
        shape = base[name].shape
        base[name] = np.broadcast_to(np.asarray(value, base[name].dtype), shape).copy()
    return SamplingMetadata(**base)


def _draws(probs: list[float], **overrides: object) -> np.ndarray:
    logits = np.tile(np.log(np.asarray(probs, np.float32)), (R, 1))
    return np.asarray(sample(logits, _md(R, **overrides)).token_ids)


PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]


def test_greedy_is_argmax() -> None:
    logits = np.random.default_rng(0).normal(size=(8, 100)).astype(np.float32)
    out = sample(logits, _md(8, temperature=0.0))
    np.testing.assert_array_equal(np.asarray(out.token_ids), logits.argmax(-1))


def test_top_k_never_leaves_the_top_k() -> None:
    tokens = _draws(PROBS, top_k=3)
    assert set(tokens.tolist()) == {0, 1, 2}


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    # mass before token 2 is 0.65 < 0.7, before token 3 it is 0.8: tokens 0..2 allowed.
    tokens = _draws(PROBS, top_p=0.7)
    assert set(tokens.tolist()) == {0, 1, 2}
    assert set(_draws(PROBS, top_p=0.01).tolist()) == {0}  # the top token always survives


def test_min_p_drops_tokens_below_a_fraction_of_the_top() -> None:
    tokens = _draws(PROBS, min_p=0.3)  # threshold 0.12: tokens 0..2
    assert set(tokens.tolist()) == {0, 1, 2}


def test_filters_compose_and_frequencies_follow_the_renormalised_distribution() -> None:
    tokens = _draws(PROBS, top_k=4, top_p=0.95, min_p=0.2)  # k: 0..3, p: 0..3, min_p 0.08: 0..3
    counts = np.bincount(tokens, minlength=len(PROBS))
    assert counts[4:].sum() == 0
    expected = np.asarray(PROBS[:4]) / sum(PROBS[:4]) * R
    assert np.all(np.abs(counts[:4] - expected) < 5 * np.sqrt(expected) + 5)


def test_temperature_flattens_the_distribution() -> None:
    tokens = _draws([0.9, 0.1], temperature=3.0)
    p1 = (0.1 ** (1 / 3)) / (0.9 ** (1 / 3) + 0.1 ** (1 / 3))  # ~0.32
    assert abs(np.mean(tokens == 1) - p1) < 0.07


def test_same_seed_and_position_give_the_same_token_whatever_the_batch_mates() -> None:
    rng = np.random.default_rng(1)
    row = rng.normal(size=(1, 50)).astype(np.float32)
    alone = sample(row, _md(1, seeds=77, positions=5, top_k=20))
    mates = rng.normal(size=(8, 50)).astype(np.float32)
    mates[6] = row[0]
    md = _md(8, seeds=[1, 2, 3, 4, 5, 6, 77, 8], positions=[0, 1, 2, 3, 4, 5, 5, 7], top_k=20)
    together = sample(mates, md)
    assert int(alone.token_ids[0]) == int(together.token_ids[6])
    again = sample(mates, md)
    chex.assert_trees_all_equal(again, together)  # every field, not just the tokens


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_row_gives_the_same_bits_in_any_request_bucket_and_at_any_row(top_p: float) -> None:
    # XLA's own log-softmax over 256 logits rounded a row differently in the 8-row bucket
    # than in the 16-row one; the sampler's sums run in an order fixed by V (model/reductions).
    rng = np.random.default_rng(3)
    mates = rng.normal(scale=4.0, size=(64, 256)).astype(np.float32)
    row = rng.normal(scale=4.0, size=256).astype(np.float32)
    outs = []
    for rows in (8, 16, 64):
        for at in (0, 5, rows - 1):
            logits = mates[:rows].copy()
            logits[at] = row
            md = _md(rows, temperature=0.8, top_p=top_p, seeds=123, positions=3, num_logprobs=4)
            out = sample(logits, md, max_logprobs=4)
            outs.append(jax.tree.map(lambda x, at=at: np.asarray(x)[at], out))
    for out in outs[1:]:
        chex.assert_trees_all_equal(out, outs[0])


def test_different_positions_draw_differently() -> None:
    tokens = _draws([1 / 16] * 16)
    assert len(set(tokens.tolist())) == 16


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_raw_log_softmax(temperature: float) -> None:
    logits = np.random.default_rng(2).normal(size=(4, 30)).astype(np.float32)
    out = sample(logits, _md(4, temperature=temperature, num_logprobs=3), max_logprobs=5)
    shifted = logits - logits.max(-1, keepdims=True)
    ref = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    tokens = np.asarray(out.token_ids)
    np.testing.assert_allclose(out.logprobs, ref[np.arange(4), tokens], atol=1e-5)
    np.testing.assert_array_equal(out.top_token_ids, np.argsort(-ref, -1)[:, :5])
    np.testing.assert_allclose(out.top_logprobs, -np.sort(-ref, -1)[:, :5], atol=1e-5)


def test_no_top_logprobs_when_nobody_asks() -> None:
    logits = np.zeros((2, 10), np.float32)
    out = sample(logits, _md(2, temperature=0.0), max_logprobs=3)
    chex.assert_shape([out.top_logprobs, out.top_token_ids], (2, 3))


def test_banned_tokens_are_never_drawn() -> None:
    logits = np.tile(np.log(np.asarray(PROBS, np.float32)), (R, 1))
    greedy = sample(logits[:4], _md(4, temperature=0.0, banned_token_ids=[0, 2]))
    assert np.asarray(greedy.token_ids).tolist() == [1] * 4
    tokens = sample(logits, _md(R, banned_token_ids=[1, -1])).token_ids
    assert 1 not in set(np.asarray(tokens).tolist())


class TestCompiledOrNot(chex.TestCase):
    """`sample_impl` runs inside other jitted functions (the runner's sampler, `generate` in the
    caller's jit), so its draws must not depend on how it is compiled: a seed has to draw the
    same token op by op as in one fused program."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_mixed_rows_keep_the_contract_and_draw_as_jitted(self) -> None:
        rng = np.random.default_rng(4)
        logits = (3 * rng.normal(size=(8, 40))).astype(np.float32)
        md = _md(8, temperature=[0, 0.7, 1, 1, 1, 1.3, 0, 2], top_k=[0, 0, 5, 0, 0, 3, 0, 0],
                 top_p=[1, 1, 1, 0.8, 1, 0.9, 1, 1], min_p=[0, 0, 0, 0, 0.1, 0, 0, 0],
                 seeds=[9, 8, 7, 6, 5, 4, 3, 2], num_logprobs=[-1, 3, 0, -1, 2, -1, 1, 3],
                 banned_token_ids=[[int(logits[0].argmax()), -1]] + [[-1, -1]] * 7)
        # jax arrays, as inside a jit (eagerly, numpy logits have no `.at` to ban tokens with)
        args = jax.tree.map(jnp.asarray, (logits, md))
        got = self.variant(sample_impl, static_argnames=("max_logprobs",))(*args, max_logprobs=3)
        tokens = np.asarray(got.token_ids)
        allowed = logits.copy()
        allowed[0, logits[0].argmax()] = -np.inf  # row 0's ban
        assert tokens[0] == allowed[0].argmax() and tokens[6] == allowed[6].argmax()  # greedy
        assert tokens[2] in np.argsort(-logits[2])[:5] and tokens[5] in np.argsort(-logits[5])[:3]
        shifted = allowed - allowed.max(-1, keepdims=True)
        raw = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))  # f32[8, 40]
        np.testing.assert_allclose(got.logprobs, raw[np.arange(8), tokens], atol=1e-5)
        want = sample(logits, md, max_logprobs=3)
        chex.assert_trees_all_equal((got.token_ids, got.top_token_ids),
                                    (want.token_ids, want.top_token_ids))
        chex.assert_trees_all_close((got.logprobs, got.top_logprobs),
                                    (want.logprobs, want.top_logprobs), atol=1e-6, rtol=1e-6)
