"""OpenAI response objects (completions and chat, whole and streamed) from `RequestOutput`s.

`Formatter` holds what one request's chunks share (id, creation time, model, endpoint) and
what has been sent so far, so each streamed chunk carries only the new text and logprobs.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from jaxengine.engine.outputs import Logprob, RequestOutput

Kind = Literal["completion", "chat"]


def random_id(kind: Kind) -> str:
    """`cmpl-...` or `chatcmpl-...`, as OpenAI names them."""
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


@dataclass(slots=True)
class Formatter:
    """Builds one request's response objects; remembers what was streamed already."""

    kind: Kind
    model: str
    tokenizer: Any  # decodes token ids for logprobs (None: ids are shown as "token_id:N")
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    sent_text: int = 0  # characters of the visible text already streamed
    sent_tokens: int = 0  # logprob entries already streamed
    text_offset: int = 0  # completions' logprobs.text_offset of the next token

    # ---- whole responses ---------------------------------------------------------------

    def response(self, out: RequestOutput, *, with_logprobs: bool) -> dict[str, Any]:
        """The non-streaming response body."""
        c = out.outputs[0]
        logprobs = self._logprobs(out, 0) if with_logprobs else None
        if self.kind == "completion":
            choice: dict[str, Any] = {"index": 0, "text": c.text, "logprobs": logprobs}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": c.text},
                      "logprobs": logprobs}
        choice.update(finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        return {**self._header(chunk=False), "choices": [choice], "usage": usage(out)}

    # ---- streaming ---------------------------------------------------------------------

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role (completions have no such chunk)."""
        if self.kind != "chat":
            return None
        delta = {"role": "assistant", "content": ""}
        return {**self._header(chunk=True),
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": None}]}

    def chunk(self, out: RequestOutput, *, with_logprobs: bool) -> dict[str, Any] | None:
        """The chunk for the text (and logprobs) new in `out`; None if there is nothing new."""
        c = out.outputs[0]
        text = c.text[self.sent_text:]
        logprobs = None
        if with_logprobs and c.logprobs is not None and len(c.logprobs) > self.sent_tokens:
            logprobs = self._logprobs(out, self.sent_tokens)
            self.sent_tokens = len(c.logprobs)
        if not text and logprobs is None and not out.finished:
            return None
        self.sent_text = len(c.text)
        if self.kind == "completion":
            choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs}
        else:
            choice = {"index": 0, "delta": {"content": text} if text else {},
                      "logprobs": logprobs}
        choice.update(finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        return {**self._header(chunk=True), "choices": [choice]}

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        """The final `stream_options.include_usage` chunk."""
        return {**self._header(chunk=True), "choices": [], "usage": usage(out)}

    # ---- pieces ------------------------------------------------------------------------

    def _header(self, *, chunk: bool) -> dict[str, Any]:
        if self.kind == "completion":
            obj = "text_completion"
        else:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.model}

    def _token(self, token_id: int) -> str:
        if self.tokenizer is None:  # --skip-tokenizer-init: vLLM's placeholder
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, out: RequestOutput, start: int) -> dict[str, Any] | None:
        c = out.outputs[0]
        if c.logprobs is None:
            return None
        ids, entries = c.token_ids[start:len(c.logprobs)], c.logprobs[start:]
        if self.kind == "chat":
            return {"content": [self._chat_entry(t, e) for t, e in zip(ids, entries,
                                                                      strict=False)]}
        tokens, token_lps, tops, offsets = [], [], [], []
        for t, e in zip(ids, entries, strict=False):
            tokens.append(self._token(t))
            token_lps.append(_finite(_sampled(t, e).logprob))
            tops.append({self._token(i): _finite(lp.logprob) for i, lp in _top(e)})
            offsets.append(self.text_offset)
            self.text_offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _chat_entry(self, token_id: int, entry: dict[int, Logprob]) -> dict[str, Any]:
        def one(tid: int, lp: Logprob) -> dict[str, Any]:
            s = self._token(tid)
            return {"token": s, "logprob": _finite(lp.logprob), "bytes": list(s.encode("utf-8"))}

        return {**one(token_id, _sampled(token_id, entry)),
                "top_logprobs": [one(i, lp) for i, lp in _top(entry)]}


def _finite(logprob: float) -> float:
    # JSON has no -inf; vLLM reports masked-out tokens as -9999.0 too.
    return logprob if logprob > -9999.0 else -9999.0  # NaN compares false: also -9999.0


def _sampled(token_id: int, entry: dict[int, Logprob]) -> Logprob:
    return entry.get(token_id) or Logprob(-9999.0)


def _top(entry: dict[int, Logprob]) -> Sequence[tuple[int, Logprob]]:
    ranked = [(i, lp) for i, lp in entry.items() if lp.rank is not None]
    return sorted(ranked, key=lambda item: item[1].rank or 0)


def usage(out: RequestOutput) -> dict[str, int]:
    """Token counts of a request."""
    prompt, completion = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}
