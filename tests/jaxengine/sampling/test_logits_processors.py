"""Penalties, logit_bias, allowed_token_ids and bad words change the logits exactly as vLLM's
formulas say (`penalty_reference.py`), row by row in one mixed batch, also when the newest
output token is still in flight (async scheduling); the sampler draws from the processed
logits and reports the raw logprobs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.runner.penalty_inputs import TableSlots
from jaxengine.sampling.bad_words import (
    MAX_BAD_WORD_BANS,
    BadWordBan,
    armed_bans,
    tokenize_bad_words,
)
from jaxengine.sampling.logits_processors import apply_logits_processors, build_adjustments
from jaxengine.sampling.request_tables import (
    init_tables,
    record_tokens,
    slot_rows,
    uses_table,
    write_slot,
)
from jaxengine.sampling.sampler import sample_impl
from scheduler import SamplingParams, SamplingParamsError
from tests.jaxengine.sampling.penalty_reference import reference_logits
from tests.jaxengine.sampling.test_sampler import _md

V, S = 50, 8
_write = jax.jit(write_slot, donate_argnames=("tables",))
_apply = jax.jit(apply_logits_processors)

# (params, bad words as tokens) of each row; a row with nothing to do gets no slot.
ROWS: list[tuple[SamplingParams, tuple[tuple[int, ...], ...]]] = [
    (SamplingParams(presence_penalty=1.5), ()),
    (SamplingParams(), ()),
    (SamplingParams(frequency_penalty=0.7, presence_penalty=-0.5), ()),
    (SamplingParams(repetition_penalty=1.8), ()),
    (SamplingParams(repetition_penalty=0.6, frequency_penalty=-1.0), ()),
    (SamplingParams(logit_bias={3: 100.0, 7: -5.5, 0: 2.0}, repetition_penalty=1.3), ()),
    (SamplingParams(allowed_token_ids=[1, 4, 9, 30], presence_penalty=2.0), ()),
    (SamplingParams(), ((11,), (8, 12), (5, 8, 13), (9, 14), (7, 7, 15))),
]


def _outputs(rng: np.random.Generator) -> list[list[int]]:
    outs = [rng.integers(0, 20, size=n).tolist() for n in (9, 4, 14, 0, 6, 8, 5, 3)]
    outs[7] = [1, 5, 8]  # (8, 12) and (5, 8, 13) armed, (9, 14) and (7, 7, 15) not
    return outs


@pytest.mark.parametrize("in_flight", [False, True])
def test_processed_logits_are_vllms_row_by_row(in_flight: bool) -> None:
    rng = np.random.default_rng(1 + in_flight)
    R = len(ROWS)
    logits = (3 * rng.normal(size=(R, V))).astype(np.float32)
    prompts = [rng.integers(0, V, size=int(rng.integers(1, 12))).tolist() for _ in range(R)]
    outputs = _outputs(rng)
    # With a step in flight, each row's newest output is only on the device (in prev_tokens).
    prev_tokens = np.zeros(S + 2, np.int32)
    tables = jax.tree.map(jnp.asarray, init_tables(S, V))
    slots, bans, prev_rows, next_slot = [], [], [], 0
    for i, ((sp, words), prompt, out) in enumerate(zip(ROWS, prompts, outputs, strict=True)):
        lag = in_flight and len(out) > 0
        host = out[:-1] if lag else out
        prev_row = i % (S + 2) if lag else -1
        if lag:
            prev_tokens[prev_row] = out[-1]
        prev_rows.append(prev_row)
        bans.append(armed_bans(words, host, len(out)))
        if not uses_table(sp, words):
            slots.append(-1)
            continue
        slot, next_slot = next_slot, next_slot + 1
        bias, pmask, counts = slot_rows(sp, prompt, host, words, V)
        tables = _write(tables, np.int32(slot), bias, pmask, counts, prev_tokens,
                        np.int32(prev_row))
        slots.append(slot)
    adj = build_adjustments([sp for sp, _ in ROWS], slots, bans, prev_rows, R)
    got = np.asarray(_apply(logits, tables, adj, prev_tokens))
    for i, ((sp, words), prompt, out) in enumerate(zip(ROWS, prompts, outputs, strict=True)):
        want = reference_logits(logits[i], sp, prompt, out, words)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6, err_msg=f"row {i}")
    np.testing.assert_array_equal(got[1], logits[1])  # a plain row is untouched
    assert np.isinf(got[7, [11, 12, 13]]).all() and np.isfinite(got[7, [14, 15]]).all()


def test_a_batch_without_any_feature_is_unchanged() -> None:
    logits = np.random.default_rng(0).normal(size=(4, V)).astype(np.float32)
    tables = jax.tree.map(jnp.asarray, init_tables(S, V))
    adj = build_adjustments([SamplingParams()] * 2, [-1, -1], [(), ()], [-1, -1], 4)
    np.testing.assert_array_equal(_apply(logits, tables, adj, np.zeros(S, np.int32)), logits)


def test_record_tokens_counts_rows_with_a_slot_only() -> None:
    tables = jax.tree.map(jnp.asarray, init_tables(S, V))
    tables = record_tokens(tables, jnp.array([2, -1, 2, 0]), jnp.array([5, 6, 5, 49]))
    counts = np.asarray(tables.output_counts)
    assert counts[2, 5] == 2 and counts[0, 49] == 1 and counts.sum() == 3


def test_sampler_draws_from_processed_logits_and_reports_raw_logprobs() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2, V)).astype(np.float32)
    bias = np.zeros((2, V), np.float32)
    bias[:, 17] = 50.0  # forces token 17

    out = jax.jit(sample_impl, static_argnames=("max_logprobs", "adjust"))(
        logits, _md(2, temperature=[0.0, 1.0], num_logprobs=[1, 1]), max_logprobs=1,
        adjust=lambda x: x + bias)
    assert np.asarray(out.token_ids).tolist() == [17, 17]
    raw = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.logprobs, raw[:, 17], atol=1e-5)
    np.testing.assert_array_equal(out.top_token_ids[:, 0], logits.argmax(-1))
    # The rank is among the raw logprobs too: 1 + the tokens the model found more likely.
    ranks = 1 + (raw > raw[:, 17:18]).sum(-1)
    assert ranks.min() > 1
    np.testing.assert_array_equal(out.ranks, ranks)


def test_slot_rows_build_bias_masks_and_counts() -> None:
    sp = SamplingParams(logit_bias={2: 1.5}, allowed_token_ids=[2, 3, 4])
    bias, prompt, counts = slot_rows(sp, [1, 1, 9], [4, 4, 3], ((3,), (2, 4)), 10)
    assert bias.tolist() == [-np.inf, -np.inf, 1.5, -np.inf, 0, *[-np.inf] * 5]
    assert np.flatnonzero(prompt).tolist() == [1, 9]
    assert counts.tolist() == [0, 0, 0, 1, 2, 0, 0, 0, 0, 0]


def test_armed_bans_follow_vllm_with_or_without_a_token_in_flight() -> None:
    words = ((5,), (1, 2), (7, 1, 3), (9, 9, 9, 4))
    # host has every output: a word fires when its prefix ends the output
    assert armed_bans(words, [7, 1], 2) == (BadWordBan(2, -1), BadWordBan(3, -1))
    assert armed_bans(words, [], 0) == ()  # one-token words are in the bias row
    assert armed_bans(words, [9, 9], 2) == ()  # (9, 9, 9, 4) needs three outputs first
    # the newest output is in flight: its comparison is left to the device (`after`)
    assert armed_bans(words, [7], 2) == (BadWordBan(2, 1), BadWordBan(3, 1))
    assert armed_bans(words, [], 1) == (BadWordBan(2, 1),)
    assert armed_bans(words, [9, 9], 3) == (BadWordBan(2, 1), BadWordBan(4, 9))
    with pytest.raises(ValueError, match="in flight"):
        armed_bans(words, [], 2)


class _Words:
    """A tokenizer of letters: 'a' is 0, ...; a leading space is its own token 26."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        del add_special_tokens
        return [26 if c == " " else ord(c) - ord("a") for c in text]


def test_bad_words_are_tokenized_as_vllm_does() -> None:
    # " ab" is [26, 0, 1]: longer than "ab", so vLLM keeps only the plain form
    assert tokenize_bad_words(_Words(), ["ab", " c"], vocab_size=30) == ((0, 1), (2,))
    with pytest.raises(SamplingParamsError, match="outside the vocabulary") as info:
        tokenize_bad_words(_Words(), ["z"], vocab_size=10)
    assert info.value.param == "bad_words"
    too_many = ["ab"] * (MAX_BAD_WORD_BANS + 1)
    with pytest.raises(SamplingParamsError, match="at most") as info:
        tokenize_bad_words(_Words(), too_many, vocab_size=30)
    assert info.value.param == "bad_words"


def test_table_slots_are_reused_and_taken_from_requests_outside_the_batch() -> None:
    slots = TableSlots(2)
    assert (slots.assign("a", ["a"]), slots.assign("b", ["a", "b"])) == (0, 1)
    slots.release(["a", "zzz"])
    assert slots.get("a") is None and slots.assign("c", ["c"]) == 0
    # full: "b" (not in the batch) gives up its slot to "d"
    assert slots.assign("d", ["c", "d"]) == 1 and slots.get("b") is None and len(slots) == 2
