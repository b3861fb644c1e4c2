"""The runner's side of verification: which hidden rows, which sampler rows, what is kept."""

from __future__ import annotations

import numpy as np
import pytest

from jaxengine.runner.verify import draftable, gather_indices, num_accepted, sampler_rows
from jaxengine.sampling.rows import SamplingRow
from scheduler import SamplingParams


@pytest.mark.parametrize(("drafts", "sampled", "accepted"), [
    ((), (7,), 0),
    ((4, 5, 6), (4, 5, 6, 9), 3),  # all accepted: the bonus token 9 too
    ((4, 5, 6), (4, 8, 6, 9), 1),  # d_1 rejected: x_1 = 8 is emitted instead
    ((4, 5, 6), (3, 5, 6, 9), 0),  # later matches after a rejection count for nothing
])
def test_num_accepted(drafts: tuple[int, ...], sampled: tuple[int, ...], accepted: int) -> None:
    assert num_accepted(drafts, sampled) == accepted


def test_num_accepted_needs_one_row_per_draft_and_one() -> None:
    with pytest.raises(ValueError, match="2 drafts need 3 sampled rows, got 2"):
        num_accepted((1, 2), (1, 2))


def test_gather_indices_pick_each_requests_last_rows() -> None:
    # Three requests of 5, 3 (the last 2 drafts) and 1 tokens, then padding; R = 4, K = 2.
    qsl = np.array([0, 5, 8, 9, 9], np.int32)
    rows = gather_indices(qsl, [0, 2, 0], num_seqs=4, width=3)
    assert rows.dtype == np.int32 and rows.shape == (12,)
    assert rows.reshape(4, 3).tolist() == [[4, 4, 4], [5, 6, 7], [8, 8, 8], [8, 8, 8]]
    assert gather_indices(np.zeros(3, np.int32), [], num_seqs=2, width=2).tolist() == [0] * 4


def test_sampler_rows_add_one_row_per_draft_at_the_next_positions() -> None:
    sp = SamplingParams(temperature=1.0)
    rows = {r: SamplingRow(params=sp, seed=s, position=p)
            for r, s, p in (("a", 1, 4), ("b", 2, 0), ("c", 3, 9))}
    ids, batch_rows, index = sampler_rows(["b", "a", "c"], ["a", "b", "c"], rows,
                                          {"a": (11, 12), "c": (13,)}, width=3)
    assert ids == ["a", "a", "a", "b", "c", "c"]
    assert [(r.seed, r.position) for r in batch_rows] == [(1, 4), (1, 5), (1, 6), (2, 0),
                                                          (3, 9), (3, 10)]
    assert index == [3, 4, 5, 0, 6, 7]  # request i's rows start at i * width


def test_requests_with_per_step_state_get_no_drafts() -> None:
    plain = SamplingParams(temperature=0.7, top_p=0.9, min_tokens=2)
    assert draftable(plain, num_output_tokens=2)
    assert not draftable(plain, num_output_tokens=1)  # min_tokens' bans still apply
    for kw in (dict(presence_penalty=0.5), dict(frequency_penalty=0.5),
               dict(repetition_penalty=1.2), dict(logit_bias={3: 1.0}),
               dict(allowed_token_ids=[1, 2]), dict(logprobs=0)):
        assert not draftable(SamplingParams(**kw), num_output_tokens=5), kw
    assert not draftable(SamplingParams(), num_output_tokens=5, bad_words_token_ids=((4, 5),))
    assert not draftable(SamplingParams(), num_output_tokens=5, has_grammar=True)
    rows = {"a": SamplingRow(params=SamplingParams(presence_penalty=0.5), seed=0, position=3)}
    with pytest.raises(ValueError, match="request 'a' has drafts"):
        sampler_rows(["a"], ["a"], rows, {"a": (1,)}, width=2)
