"""Host side of sampling: the engine's checks of `SamplingParams`, packing rows into arrays."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from jaxengine.sampling.sampler import SamplingMetadata
from scheduler import SamplingParams, SamplingParamsError

if TYPE_CHECKING:
    from jaxengine.structured.matcher import GrammarMatcher

MAX_BANNED = 8  # stop token ids (+ EOS) a request with min_tokens may have
TOP_K_MAX = 2**31 - 1  # i32 in the metadata; any top_k >= V means "off" to the sampler


def validate_sampling_params(sp: SamplingParams, *, max_logprobs: int,
                             vocab_size: int | None) -> None:
    """The checks that need the engine; `SamplingParams` made every other one when built.

    Args:
      sp: the request's parameters.
      max_logprobs: the engine's cap on `logprobs` and `prompt_logprobs`.
      vocab_size: when known, the token ids of stop_token_ids, logit_bias and
        allowed_token_ids must be below it.
    Raises:
      SamplingParamsError: naming the field (`param`) and saying what to change.
    """
    for name in ("logprobs", "prompt_logprobs"):
        n = getattr(sp, name)
        if n is not None and n > max_logprobs:
            raise SamplingParamsError(
                f"{name} must be in [0, max_logprobs={max_logprobs}] (the engine's cap), got "
                f"{n}", param=name, value=n)
    # The banned-token array has a fixed width, so that it never recompiles the sampler.
    if sp.min_tokens > 0 and len(sp.stop_token_ids) + 1 > MAX_BANNED:
        raise SamplingParamsError(
            f"with min_tokens > 0, at most {MAX_BANNED - 1} stop_token_ids are supported, got "
            f"{len(sp.stop_token_ids)}", param="stop_token_ids", value=sp.stop_token_ids)
    if vocab_size is None:
        return
    for name, ids in (("stop_token_ids", sp.stop_token_ids),
                      ("logit_bias", sp.logit_bias or ()),
                      ("allowed_token_ids", sp.allowed_token_ids or ())):
        for t in ids:
            if t >= vocab_size:
                raise SamplingParamsError(
                    f"{name} must hold token ids in [0, vocab_size={vocab_size}), got {t}",
                    param=name, value=t)


@dataclass(slots=True, kw_only=True)
class SamplingRow:
    """What one request contributes to a sampling batch.

    Nothing changes a row once it is built; it is not frozen because the engine builds one per
    sampling request and step, and a frozen dataclass's `__init__` costs three times as much.
    """

    params: SamplingParams
    seed: int  # the request's own seed or one the engine drew; the sampler keys on its low 32 bits
    position: int  # index of the output token being drawn
    eos_token_id: int | None = None  # banned with the stop ids while position < min_tokens
    # For penalties and bad words (read, not copied; the runner reads them while packing):
    prompt_token_ids: Sequence[int] = ()  # the repetition penalty counts them
    output_token_ids: Sequence[int] = ()  # outputs on the host: `position`, or one fewer
    # while the last is in flight (async scheduling)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # of `params.bad_words`
    # `params.structured_outputs`' matcher, advanced past every output on the host (the runner
    # fills the row's token bitmask from it when it packs the step); None: no grammar.
    grammar: GrammarMatcher | None = None


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


def banned_ids(sp: SamplingParams, eos_token_id: int | None) -> tuple[int, ...]:
    """Tokens `min_tokens` holds back: the stop token ids, and EOS unless `ignore_eos`."""
    ids = tuple(sp.stop_token_ids)
    if eos_token_id is not None and not sp.ignore_eos:
        ids = (eos_token_id, *ids)
    return ids
