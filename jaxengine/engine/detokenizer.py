"""Incremental detokenization and stop strings, as vLLM V1's detokenizer does them.

Text is decoded one token at a time by the tokenizer's decode stream (`tokenizers`'
`DecodeStream`, from `Tokenizer.decode_stream`), which decodes a short window of ids and
returns only the new text, or None while the window ends in an incomplete UTF-8 character
(byte-level BPE, byte fallback) or a skipped special token. As vLLM's FastIncrementalDetokenizer
does, the stream is first fed a few prompt tokens, so the first generated word gets its leading
space right. Stop strings are searched only in the region the new text can touch; a match
truncates the text (before the stop string unless `include_stop_str_in_output`) and becomes
the request's `stop_reason`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

logger = logging.getLogger("jaxengine.engine")

# The prompt tokens a stream starts from: the shortest suffix of at least this many, of at most
# the last _MAX_PRIME, that decodes to whole characters (vLLM's choice).
_MIN_PRIME, _MAX_PRIME = 4, 23
# What tokenizers' DecodeStream raises when a decoder's output stops extending its earlier
# output (byte-fallback bytes that no longer form valid UTF-8); vLLM restarts the stream.
_INVALID_PREFIX = "Invalid prefix encountered"


class TokenStream(Protocol):
    """Incremental decoding of one sequence."""

    def step(self, token_id: int) -> str | None:
        """Feed one token; its new text, or None while nothing printable was completed."""
        ...


class StreamingTokenizer(Protocol):
    """What detokenization needs from a tokenizer (`jaxengine.loading.tokenizer.Tokenizer`)."""

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        ...

    def decode_stream(self, *, skip_special_tokens: bool = True) -> TokenStream:
        """A fresh incremental decoder."""
        ...


class IncrementalDetokenizer:
    """The growing output text of one request, with stop-string handling."""

    def __init__(self, tokenizer: StreamingTokenizer, prompt_token_ids: Sequence[int], *,
                 stop: Sequence[str] = (), min_tokens: int = 0,
                 include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True) -> None:
        """Args:
          tokenizer: gives the decode stream (and `decode`, for logprob tokens).
          prompt_token_ids: the prompt; its last few tokens give the first word its context.
          stop: stop strings; checked once more than `min_tokens` tokens were generated.
          include_stop_str_in_output: keep the matched stop string in the text.
          skip_special_tokens: special tokens add no text.
        """
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.min_tokens = min_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self._stream = tokenizer.decode_stream(skip_special_tokens=skip_special_tokens)
        for token in _priming_ids(tokenizer, prompt_token_ids):
            self._step(token)
        self.num_output_tokens = 0
        self.output_text = ""
        self._text_before_last = 0  # len(output_text) before the last token was decoded

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Add tokens; return the stop string that matched, if one did (text is then trimmed).

        Args:
          new_token_ids: the request's tokens of this step.
        """
        for token in new_token_ids:
            self.num_output_tokens += 1
            self._text_before_last = len(self.output_text)
            new_chars = self._decode_next(token)
            if self.stop and self.num_output_tokens > self.min_tokens:
                hit = self._check_stop(len(new_chars))
                if hit is not None:
                    return hit
        return None

    def drop_last_token(self) -> None:
        """Take back the text the last token added; it still counts as an output token.

        For a request that EOS or a stop token id ended: vLLM never decodes that token. The
        engine decodes each token before the scheduler decides (so that a stop string reaches
        the scheduler with its token), and takes the text back once the scheduler has said.
        """
        self.output_text = self.output_text[: self._text_before_last]

    def _decode_next(self, token: int) -> str:
        delta = self._step(token) or ""  # None: a partial UTF-8 character, a special token
        self.output_text += delta
        return delta

    def _step(self, token: int) -> str | None:
        try:
            return self._stream.step(token)
        except Exception as e:  # tokenizers raises a plain Exception
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            # vLLM's recovery (vllm#17448): a fresh stream, without context, from this token
            logger.warning("detokenizer: %s; restarting the decode stream", e)
            self._stream = self.tokenizer.decode_stream(
                skip_special_tokens=self.skip_special_tokens)
            return self._stream.step(token)

    def _check_stop(self, new_char_count: int) -> str | None:
        text = self.output_text
        for stop_str in self.stop:
            # a match must end inside the new text: start no earlier than this
            start = max(0, len(text) - new_char_count - len(stop_str) + 1)
            index = text.find(stop_str, start)
            if index == -1:
                continue
            if self.include_stop_str_in_output:
                index += len(stop_str)
            self.output_text = text[:index]
            return stop_str
        return None

    def visible_text(self, *, finished: bool) -> str:
        """Text safe to show now: while running, hold back a tail that may start a stop string."""
        if finished or not self.stop or self.include_stop_str_in_output:
            return self.output_text
        hold = max(len(s) for s in self.stop) - 1
        return self.output_text[: max(len(self.output_text) - hold, 0)]


def _priming_ids(tokenizer: StreamingTokenizer, prompt: Sequence[int]) -> Sequence[int]:
    """The prompt tokens a stream starts from, as vLLM's FastIncrementalDetokenizer picks them:
    the shortest suffix of 4 to 23 tokens that decodes without U+FFFD (so it starts and ends on
    whole characters), else the whole prompt."""
    for n in range(_MIN_PRIME, min(len(prompt), _MAX_PRIME) + 1):
        suffix = prompt[-n:]
        if "\ufffd" not in tokenizer.decode(suffix):
            return suffix
    return prompt
