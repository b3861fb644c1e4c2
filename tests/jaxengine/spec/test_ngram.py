"""The prompt-lookup proposer against hand-made sequences and vLLM's KMP search."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine.spec import propose_ngram


def vllm_kmp(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's `_find_longest_matched_ngram_and_propose_tokens` (v1/spec_decode/ngram_proposer.py)
    transcribed: the longest prefix of the reversed tokens that recurs, by KMP."""
    total = len(tokens)
    if total < min_n:
        return []
    rev = tokens[::-1]
    lps = [0] * max_n
    longest = position = prev = 0
    i = 1
    while i < total:
        if rev[prev] == rev[i]:
            prev += 1
            if prev >= longest:
                longest, position = prev, i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev != 0:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - position + longest
    return tokens[start:start + min(k, total - start)]


@pytest.mark.parametrize(("tokens", "min_n", "max_n", "k", "want"), [
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),  # suffix [2, 3] follows with 4, 1
    ([1, 2, 3, 4, 1, 2, 3], 2, 3, 5, [4, 1, 2, 3]),  # only 4 tokens follow the match
    ([1, 2, 3, 4, 1, 2, 3, 5, 2, 3], 2, 3, 2, [4, 1]),  # [2, 3] twice: the earliest wins
    ([5, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 3, 2, [7, 1]),  # the longer [1, 2, 3] wins
    ([1, 2, 3, 4, 5], 1, 3, 3, []),  # no suffix recurs
    ([1, 2, 3, 9, 3], 2, 4, 3, []),  # [3] recurs, but min_n is 2
    ([1, 2, 3, 9, 3], 1, 4, 3, [9, 3]),
    ([7, 7, 7, 7], 1, 3, 3, [7]),  # a match may overlap the suffix
    ([4], 1, 3, 3, []),
    ([1, 2, 1, 2], 2, 2, 0, []),
])
def test_hand_made_sequences(tokens: list[int], min_n: int, max_n: int, k: int,
                             want: list[int]) -> None:
    assert propose_ngram(tokens, min_n=min_n, max_n=max_n, k=k) == want
    assert propose_ngram(np.asarray(tokens), min_n=min_n, max_n=max_n, k=k) == want


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40),
       min_n=st.integers(1, 4), extra=st.integers(0, 3), k=st.integers(1, 6))
def test_agrees_with_vllms_kmp_search(tokens: list[int], min_n: int, extra: int,
                                      k: int) -> None:
    max_n = min_n + extra
    assert propose_ngram(tokens, min_n=min_n, max_n=max_n, k=k) == vllm_kmp(tokens, min_n,
                                                                            max_n, k)
