"""Host side of sampling: validate `SamplingParams`, pack rows into fixed-size arrays."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxengine.sampling.sampler import SamplingMetadata

MAX_BANNED = 8  # stop token ids (+ EOS) a request with min_tokens may have
# vLLM's bounds on a request's seed (torch.long). Negative seeds are valid there, so here too;
# the sampler keys on the low 32 bits (`SamplingRow.seed & 0xFFFFFFFF`).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
TOP_K_MAX = 2**31 - 1  # i32 in the metadata; any top_k >= V means "off" to the sampler


def validate_sampling_params(sp: Any, *, max_logprobs: int, vocab_size: int | None) -> None:
    """Raise `ValueError` naming the bad value of a `SamplingParams`.

    Args:
      sp: a `scheduler.SamplingParams`.
      max_logprobs: the engine's cap on `logprobs`.
      vocab_size: when known, `top_k` and stop token ids are checked against it.
    """
    if sp.max_tokens is not None and (not _is_int(sp.max_tokens) or sp.max_tokens <= 0):
        raise ValueError(f"max_tokens must be a positive integer or None, got {sp.max_tokens!r}")
    if not _is_int(sp.min_tokens) or sp.min_tokens < 0 or (
        sp.max_tokens is not None and sp.min_tokens > sp.max_tokens
    ):
        raise ValueError(
            f"min_tokens must be in [0, max_tokens={sp.max_tokens}], got {sp.min_tokens!r}"
        )
    # inf and NaN are refused: a NaN fails every comparison below, inf needs isfinite.
    if not _is_real(sp.temperature) or not sp.temperature >= 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got "
                         f"{sp.temperature!r}")
    if not _is_real(sp.top_p) or not 0 < sp.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {sp.top_p!r}")
    if not _is_real(sp.min_p) or not 0 <= sp.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {sp.min_p!r}")
    if not _is_int(sp.top_k) or sp.top_k < -1:
        raise ValueError(f"top_k must be -1 or 0 (off) or a positive integer, got {sp.top_k!r}")
    if sp.seed is not None and not (_is_int(sp.seed) and SEED_MIN <= sp.seed <= SEED_MAX):
        raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (int64, as "
                         f"vLLM), or None; got {sp.seed!r}")
    lp = sp.logprobs
    if lp is not None and (not _is_int(lp) or not 0 <= lp <= max_logprobs):
        raise ValueError(f"logprobs must be in [0, max_logprobs={max_logprobs}], got {sp.logprobs}")
    stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop)
    if any(not isinstance(s, str) or not s for s in stops):
        raise ValueError(f"stop must be non-empty strings, got {sp.stop!r}")
    if sp.min_tokens > 0 and len(sp.stop_token_ids) + 1 > MAX_BANNED:
        raise ValueError(f"with min_tokens > 0, at most {MAX_BANNED - 1} stop_token_ids are "
                         f"supported, got {len(sp.stop_token_ids)}")
    for t in sp.stop_token_ids:
        if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
            raise ValueError(f"stop_token_ids must be token ids in [0, vocab), got {t!r}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    """A finite int or float (not a bool, a string, inf or NaN)."""
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool) \
        and math.isfinite(x)


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingRow:
    """What one request contributes to a sampling batch."""

    params: Any  # scheduler.SamplingParams
    seed: int  # the request's own seed, or one the engine drew for it
    position: int  # index of the output token being drawn
    eos_token_id: int | None = None  # banned with the stop ids while position < min_tokens


def build_sampling_metadata(
    rows: Sequence[SamplingRow], num_rows: int, *, max_banned: int = MAX_BANNED
) -> SamplingMetadata:
    """Pack rows into numpy arrays of size `num_rows` (the request bucket); padding is greedy.

    Args:
      rows: one per sampling request, in the order of the logits rows.
      num_rows: R, at least `len(rows)`.
      max_banned: S, width of the banned-token array (fixed, so it never recompiles).
    Returns:
      SamplingMetadata of numpy arrays (f32/i32/u32[R]).
    """
    if len(rows) > num_rows:
        raise ValueError(f"{len(rows)} sampling rows do not fit a bucket of {num_rows}")
    temperature = np.zeros(num_rows, np.float32)
    top_k = np.zeros(num_rows, np.int32)
    top_p = np.ones(num_rows, np.float32)
    min_p = np.zeros(num_rows, np.float32)
    seeds = np.zeros(num_rows, np.uint32)
    positions = np.zeros(num_rows, np.int32)
    num_logprobs = np.full(num_rows, -1, np.int32)
    banned = np.full((num_rows, max_banned), -1, np.int32)
    for i, row in enumerate(rows):
        sp = row.params
        temperature[i] = sp.temperature
        top_k[i] = min(max(sp.top_k, 0), TOP_K_MAX)  # a huge top_k must not overflow i32
        top_p[i] = sp.top_p
        min_p[i] = sp.min_p
        seeds[i] = row.seed & 0xFFFFFFFF
        positions[i] = row.position
        num_logprobs[i] = -1 if sp.logprobs is None else sp.logprobs
        if row.position < sp.min_tokens:
            ids = banned_ids(sp, row.eos_token_id)
            banned[i, : len(ids)] = ids
    return SamplingMetadata(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeds=seeds,
        positions=positions,
        num_logprobs=num_logprobs,
        banned_token_ids=banned,
    )


def banned_ids(sp: Any, eos_token_id: int | None) -> tuple[int, ...]:
    """Tokens `min_tokens` holds back: the stop token ids, and EOS unless `ignore_eos`."""
    ids = tuple(sp.stop_token_ids)
    if eos_token_id is not None and not sp.ignore_eos:
        ids = (eos_token_id, *ids)
    return ids
