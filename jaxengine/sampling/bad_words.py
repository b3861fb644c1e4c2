"""`bad_words` as vLLM applies them: token sequences whose last token is banned after a prefix.

A bad word is tokenized as vLLM's `SamplingParams.update_from_tokenizer` does, with and without
a leading space (so the word is banned at the start of the text and in the middle). Its last
token is banned at a step when the tokens before it are the end of the output so far; a
one-token word is always banned (`request_tables.py` puts it in the request's bias row).

Async scheduling packs a step while the previous one is in flight, so the host may lack the
newest output token. The host then matches all but the last token of the prefix and leaves the
last comparison to the device (`BadWordBan.after`), where the token in flight is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from scheduler import SamplingParamsError

MAX_BAD_WORD_BANS = 16  # multi-token bad words (as token sequences) a request may have



class _Encoder(Protocol):
    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...


class BadWordBan(NamedTuple):
    """One token to ban at this step, maybe on a condition the device checks."""

    token_id: int  # banned
    after: int  # ... only if the output token in flight is this one; -1: unconditionally


def tokenize_bad_words(tokenizer: _Encoder, bad_words: Sequence[str], *, vocab_size: int
                       ) -> tuple[tuple[int, ...], ...]:
    """Token sequences of `bad_words`, as vLLM's `update_from_tokenizer` builds them.

    Raises:
      SamplingParamsError: a word that encodes to no tokens or to ids past the vocabulary,
        or more than `MAX_BAD_WORD_BANS` multi-token sequences (the per-step ban array of the
        sampler has that fixed width).
    """
    out: list[tuple[int, ...]] = []
    for word in bad_words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise SamplingParamsError(f"bad_words: {word!r} encodes to no tokens",
                                      param="bad_words", value=word)
        out.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        # vLLM keeps the spaced form only if it is a different first token, same length.
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    bad = [t for w in out for t in w if not 0 <= t < vocab_size]
    if bad:
        raise SamplingParamsError(f"bad_words encode to token ids {bad} outside the vocabulary "
                                  f"[0, {vocab_size})", param="bad_words", value=list(bad_words))
    multi = sum(len(w) > 1 for w in out)
    if multi > MAX_BAD_WORD_BANS:
        raise SamplingParamsError(
            f"bad_words make {multi} multi-token sequences (each word counts once or twice: "
            f"with and without a leading space); at most {MAX_BAD_WORD_BANS} are supported",
            param="bad_words", value=list(bad_words))
    return tuple(out)


def armed_bans(words: Sequence[Sequence[int]], output_token_ids: Sequence[int],
               num_outputs: int) -> tuple[BadWordBan, ...]:
    """Bans of the multi-token bad words for the draw of output `num_outputs`.

    Args:
      words: token sequences of the request's bad words (one-token words are skipped here).
      output_token_ids: the outputs the host has: `num_outputs` of them, or one fewer while
        the last is in flight.
      num_outputs: index of the output being drawn (the number before it).
    Returns:
      The bans whose prefix matches the output (or will, if the token in flight is `after`).
    Raises:
      ValueError: the host lags by more than the one step in flight.
    """
    lag = num_outputs - len(output_token_ids)
    if lag not in (0, 1):
        raise ValueError(f"the host has {len(output_token_ids)} outputs of {num_outputs}: "
                         f"at most one may be in flight")
    bans = []
    for w in words:
        n = len(w) - 1  # prefix length
        if n == 0 or n > num_outputs:  # vLLM: skip a word longer than the output plus one
            continue
        known = w[:n - lag]  # what the host can compare
        tail = output_token_ids[len(output_token_ids) - len(known):] if known else ()
        if tuple(tail) == tuple(known):
            bans.append(BadWordBan(w[-1], w[n - 1] if lag else -1))
    return tuple(bans)
