"""Prompt-lookup drafts (vLLM's `NgramProposer`): copy what followed the context's suffix.

For a request's tokens (prompt + outputs), try the suffix n-grams from `prompt_lookup_max`
tokens down to `prompt_lookup_min`; the first (longest) one that also occurs earlier, at its
earliest occurrence, proposes the up to k tokens that followed it there. vLLM finds the same
match with a KMP scan of the reversed tokens (longest match, then the earliest occurrence);
here a numpy window comparison per n does it, host side, in O(n_max * tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


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
    head = arr[:-1]  # an earlier occurrence ends before the last token
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        hits = np.flatnonzero((sliding_window_view(head, n) == arr[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n  # the token after the earliest occurrence
            return arr[start:start + k].tolist()
    return []
