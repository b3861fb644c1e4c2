"""Token bitmasks on the host: one i32[W] row per request of a step, W = ceil(V / 32).

Bit `t % 32` of word `t // 32` is set when token t is allowed (llguidance's layout, and
vLLM's). A row of all ones (-1) constrains nothing. `apply_token_bitmask`
(jaxengine/structured/apply.py) applies the array to the logits on the device.
"""

from collections.abc import Sequence

import llguidance
import numpy as np

from jaxengine.structured.matcher import GrammarMatcher

ALL_ALLOWED = -1  # an i32 word with every bit set


def bitmask_width(vocab_size: int) -> int:
    """W = ceil(V / 32), the i32 words of one row."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size}; give the model's vocabulary size (>= 1)")
    return -(-vocab_size // 32)


def allocate_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """i32[R, ceil(V/32)], every token allowed."""
    return np.full((num_rows, bitmask_width(vocab_size)), ALL_ALLOWED, dtype=np.int32)


def fill_bitmasks(matchers: Sequence[GrammarMatcher | None], out: np.ndarray,
                  executor: llguidance.LLExecutor | None = None) -> np.ndarray:
    """Fill the bitmask of one step: row r for `matchers[r]`.

    Rows whose matcher is None (no grammar) or terminated are all ones, as in vLLM; rows past
    `len(matchers)` (padding) are left as they are.

    Args:
        matchers: per row, the request's matcher or None.
        out: i32[R, W] with R >= len(matchers), C-contiguous; written in place.
        executor: llguidance's thread pool (`GrammarCompiler.executor`) to fill the rows in
            parallel; None fills them one by one on this thread.
    Returns:
        `out`.
    """
    if (out.dtype != np.int32 or out.ndim != 2 or out.shape[0] < len(matchers)
            or not out.flags["C_CONTIGUOUS"]):
        raise ValueError(f"bitmask: need a contiguous i32[R, W] array with R >= "
                         f"{len(matchers)}, got {out.dtype}{list(out.shape)}")
    constrained = []
    for r, m in enumerate(matchers):
        if m is None or m.is_terminated:
            out[r] = ALL_ALLOWED
        else:
            constrained.append((m, r))
    if executor is not None and constrained:
        executor.unsafe_compute_mask_ptr([(m.ll_matcher, r) for m, r in constrained],
                                         out.ctypes.data, out.shape[1] * 4, out.shape[0])
    else:
        for m, r in constrained:
            m.fill_bitmask(out[r])
    return out
