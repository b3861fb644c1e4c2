"""Incremental detokenization and stop strings, as vLLM V1's detokenizer does them.

Text is decoded a few tokens at a time with two offsets (`prefix_offset`, `read_offset`): the
window `ids[prefix_offset:]` is decoded and only the text past the already-read part is new.
A window whose text ends in U+FFFD (an incomplete UTF-8 sequence of byte-level BPE) waits for
the next token. Stop strings are searched only in the region the new text can touch; a match
truncates the text (before the stop string unless `include_stop_str_in_output`) and becomes
the request's `stop_reason`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens decoded together with the first outputs so the first word gets its leading
# space right (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
PROMPT_CONTEXT = 5


class Decoder(Protocol):
    """What detokenization needs from a tokenizer."""

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """The growing output text of one request, with stop-string handling."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int], *,
                 stop: Sequence[str] = (), min_tokens: int = 0,
                 include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True) -> None:
        """Args:
          tokenizer: anything with `decode(ids, skip_special_tokens=...)`.
          prompt_token_ids: the prompt; its last few tokens give the first word its context.
          stop: stop strings; checked once more than `min_tokens` tokens were generated.
          include_stop_str_in_output: keep the matched stop string in the text.
          skip_special_tokens: passed to `decode`.
        """
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.min_tokens = min_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.num_output_tokens = 0
        self.output_text = ""

    def update(self, new_token_ids: Sequence[int], *, skip_last: bool = False) -> str | None:
        """Add tokens; return the stop string that matched, if one did (text is then trimmed).

        Args:
          new_token_ids: the request's tokens of this step.
          skip_last: the last token ended the request (EOS or a stop token id): count it but
            do not decode it, as vLLM does.
        """
        for i, token in enumerate(new_token_ids):
            self.num_output_tokens += 1
            if skip_last and i == len(new_token_ids) - 1:
                break
            new_chars = self._decode_next(token)
            if self.stop and self.num_output_tokens > self.min_tokens:
                hit = self._check_stop(len(new_chars))
                if hit is not None:
                    return hit
        return None

    def _decode_next(self, token: int) -> str:
        self._ids.append(token)
        ids, start, skip = self._ids, self._prefix_offset, self.skip_special_tokens
        prefix = self.tokenizer.decode(ids[start : self._read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(ids[start:], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing printable yet (a partial UTF-8 character, or a special token)
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.output_text += delta
        return delta

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
