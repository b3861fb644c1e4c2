"""Prompt-lookup drafts (vLLM's `NgramProposer`): copy what followed the context's suffix.

For a request's tokens (prompt + outputs), try the suffix n-grams from `prompt_lookup_max`
tokens down to `prompt_lookup_min`; the first (longest) one that also occurs earlier, at its
earliest occurrence, proposes the up to k tokens that followed it there. vLLM finds the same
match with a KMP scan of the reversed tokens (longest match, then the earliest occurrence).
Here, host side: the earlier positions holding the last token are the candidate match ends,
and one comparison of their max_n preceding tokens gives each one's match length, so a step
costs O(tokens) for the scan plus O(candidates * max_n).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int] | np.ndarray, *, min_n: int, max_n: int,
                  k: int) -> list[int]:
    """Draft tokens for one request.

    Args:
      tokens: the request's prompt then output token ids.
      min_n, max_n: the suffix n-gram lengths tried, longest first.
      k: the most tokens proposed (fewer when fewer follow the match).
    Returns:
      Up to k token ids; [] when no suffix n-gram in [min_n, max_n] occurs earlier.
    """
    arr = np.asarray(tokens, dtype=np.int64)
    total = len(arr)
    if k <= 0 or total < min_n + 1:
        return []
    ends = np.flatnonzero(arr[:-1] == arr[-1])  # i64[C]  where an earlier occurrence ends
    if not len(ends):
        return []
    back = np.arange(min(max_n, total - 1))  # i64[n]  offsets back from a match's end
    before = ends[:, None] - back[None, :]  # i64[C, n]
    same = (before >= 0) & (arr[np.maximum(before, 0)] == arr[total - 1 - back][None, :])
    length = np.cumprod(same, axis=1).sum(axis=1)  # i64[C]  each candidate's match length
    longest = int(length.max())
    if longest < min_n:
        return []
    start = int(ends[np.argmax(length >= longest)]) + 1  # after the earliest longest match
    return arr[start:start + k].tolist()
