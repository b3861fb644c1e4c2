"""OpenAI response objects (completions and chat, whole and streamed) from `RequestOutput`s.

`Formatter` holds what one request's chunks share (id, creation time, model, endpoint) and
what each choice has sent so far, so each streamed chunk carries only the new text and logprobs.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from jaxengine.engine.outputs import Logprob, RequestOutput
from jaxengine.server.structured import ToolChoice, tool_call
from jaxengine.server.tool_stream import ToolCallStream

Kind = Literal["completion", "chat"]


def request_ids(kind: Kind, base: str | None, n: int) -> tuple[str, list[str]]:
    """A response's id and the engine's ids of its `n` choices.

    The response's id is `cmpl-...` or `chatcmpl-...`, as OpenAI names them, then `base` (the
    client's X-Request-Id or `request_id`, as vLLM uses it) or a random part. The engine's ids
    add a random suffix, as vLLM's do, so that two clients sending the same id at once both run;
    then `-i` per choice when there are several.
    """
    response_id = ("cmpl-" if kind == "completion" else "chatcmpl-") + (base or uuid.uuid4().hex)
    unique = f"{response_id}-{uuid.uuid4().hex[:16]}"
    return response_id, [unique] if n == 1 else [f"{unique}-{i}" for i in range(n)]


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


@dataclass(slots=True)
class _Sent:
    """What one choice has streamed so far."""

    text: int = 0  # characters of the visible text
    tokens: int = 0  # logprob entries
    text_offset: int = 0  # completions' logprobs.text_offset of the next token
    echoed: bool = False  # its echo (the prompt's text) went out
    tool_call: bool = False  # a named tool's call opened (its id and name went out)
    tool_calls: ToolCallStream = field(default_factory=ToolCallStream)  # "required"'s calls


@dataclass(slots=True)
class Formatter:
    """Builds one request's response objects; remembers what each choice streamed already.

    Choice i is the i-th request of the group (`RequestGroup.index`): prompt p's n samples are
    choices p*n .. p*n+n-1, as in vLLM.
    """

    kind: Kind
    model: str
    tokenizer: Any  # decodes token ids for logprobs (None: ids are shown as "token_id:N")
    request_id: str
    echo: Sequence[str] = ()  # per choice, the text before its own (vLLM's `echo`)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:N" tokens
    tool_choice: ToolChoice | None = None  # chat: the output is tool calls (structured.py)
    # completions' echo with logprobs: the prompt's tokens lead, with the request's `logprobs`
    # top entries each (vLLM caps a larger prompt_logprobs there at logprobs + 1)
    echo_logprobs: int | None = None
    echo_only: bool = False  # completions' echo with max_tokens 0: the prompt alone
    # chat: each token's `top_logprobs` are the n best alone (a completion's top dict also
    # holds the sampled token, up to logprobs + 1 entries, as OpenAI's legacy API and vLLM's)
    top_logprobs: int = 0
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field in the response
    created: int = field(default_factory=lambda: int(time.time()))
    sent: dict[int, _Sent] = field(default_factory=dict)

    # ---- whole responses ---------------------------------------------------------------

    def response(self, outs: Sequence[RequestOutput], *, with_logprobs: bool,
                 prompt_tokens: int) -> dict[str, Any]:
        """The non-streaming response body (`prompt_tokens`: the prompts' tokens, each prompt
        counted once however many samples it has)."""
        choices = []
        for i, out in enumerate(outs):
            c = out.outputs[0]
            logprobs = self._logprobs(i, out, 0, echo=True) if with_logprobs else None
            text = self._echo(i) + ("" if self.echo_only else c.text)
            if self.kind == "completion":
                choice: dict[str, Any] = {"index": i, "text": text, "logprobs": logprobs}
            else:
                choice = {"index": i, "message": self._message(text), "logprobs": logprobs}
            choice.update(finish_reason=self._finish_reason(c.finish_reason, choice),
                          stop_reason=c.stop_reason)
            if self.prompt_logprobs and self.kind == "completion":  # vLLM: on each choice
                choice["prompt_logprobs"] = prompt_logprobs_json(out)
            choices.append(choice)
        body = {**self._header(chunk=False), "choices": choices,
                "usage": usage(prompt_tokens, outs)}
        if self.prompt_logprobs and self.kind == "chat":  # vLLM: on the response
            body["prompt_logprobs"] = prompt_logprobs_json(outs[0])
        return body

    # ---- streaming ---------------------------------------------------------------------

    def first_chunks(self, num_choices: int, *,
                     usage_of: Sequence[dict[str, int]] | None = None) -> list[dict[str, Any]]:
        """Chat streams open with the assistant role for each choice, then each choice's echo
        (vLLM's order); completions have no such chunks. `usage_of`: each choice's usage so
        far (vLLM's continuous_usage_stats)."""
        if self.kind != "chat":
            return []
        chunks = [self._chat_chunk(i, {"role": "assistant", "content": ""}, usage_of)
                  for i in range(num_choices)]
        for i in range(num_choices):
            if self._echo(i):
                chunks.append(self._chat_chunk(i, {"content": self._echo(i)}, usage_of))
            self._sent_of(i).echoed = True
        return chunks

    def chunk(self, index: int, out: RequestOutput, *, with_logprobs: bool,
              usage_so_far: dict[str, int] | None = None) -> dict[str, Any] | None:
        """Choice `index`'s chunk for the text (and logprobs) new in `out`; None if there is
        nothing new. `usage_so_far`: added to the chunk (continuous_usage_stats)."""
        c, sent = out.outputs[0], self._sent_of(index)
        text = "" if self.echo_only else c.text[sent.text:]
        logprobs = None
        new_logprobs = c.logprobs is not None and len(c.logprobs) > sent.tokens
        if with_logprobs and (new_logprobs or not sent.echoed):
            # completions: the prompt's logprobs lead the first chunk, with its text (vLLM)
            logprobs = self._logprobs(index, out, sent.tokens, echo=not sent.echoed)
            sent.tokens = len(c.logprobs or ())
        if not text and logprobs is None and not out.finished:
            return None
        sent.text = len(c.text)
        if not sent.echoed:  # completions: the prompt goes out with the first text
            text, sent.echoed = self._echo(index) + text, True
        if self.kind == "completion":
            choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs}
        else:
            delta = self._delta(sent, text, c.text)
            if not delta and logprobs is None and not out.finished:
                return None  # "required": nothing of a call complete enough to send yet
            choice = {"index": index, "delta": delta, "logprobs": logprobs}
        reason = c.finish_reason
        if reason == "stop" and self._required and sent.tool_calls.opened:
            reason = "tool_calls"  # vLLM's, as for the whole response
        choice.update(finish_reason=reason, stop_reason=c.stop_reason)
        body = {**self._header(chunk=True), "choices": [choice]}
        if usage_so_far is not None:
            body["usage"] = usage_so_far
        return body

    def usage_chunk(self, prompt_tokens: int, outs: Sequence[RequestOutput]) -> dict[str, Any]:
        """The final `stream_options.include_usage` chunk (counts as in `response`)."""
        return {**self._header(chunk=True), "choices": [],
                "usage": usage(prompt_tokens, outs)}

    # ---- pieces ------------------------------------------------------------------------

    def _message(self, text: str) -> dict[str, Any]:
        """A chat reply: its text, or its tool calls (content null) when a tool was asked
        for and the text holds them."""
        calls = None if self.tool_choice is None else self.tool_choice.tool_calls(text)
        if calls is None:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": None, "tool_calls": calls}

    @property
    def _required(self) -> bool:
        return self.tool_choice is not None and self.tool_choice.name is None

    def _finish_reason(self, reason: str | None, choice: dict[str, Any]) -> str | None:
        """vLLM's: "tool_calls" for tool_choice "required" that stopped with its calls; a
        named tool's call keeps the engine's reason."""
        if self._required and reason == "stop" and "tool_calls" in choice.get("message", {}):
            return "tool_calls"
        return reason

    def _delta(self, sent: _Sent, text: str, whole: str) -> dict[str, Any]:
        """A streamed chat delta: text; for a named tool the arguments' new text (vLLM's
        stream: the first delta opens the call with its id and name); for "required" the
        calls' new parts, from the `whole` output so far (`jaxengine/server/tool_stream.py`)."""
        if self._required:
            calls = sent.tool_calls.deltas(whole)
            return {"tool_calls": calls} if calls else {}
        if not text:
            return {}
        if self.tool_choice is None or self.tool_choice.name is None:
            return {"content": text}
        call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        if not sent.tool_call:
            sent.tool_call = True
            call = {"index": 0, **tool_call(self.tool_choice.name, text)}
        return {"tool_calls": [call]}

    def _sent_of(self, index: int) -> _Sent:
        return self.sent.setdefault(index, _Sent())

    def _echo(self, index: int) -> str:
        return self.echo[index] if index < len(self.echo) else ""

    def _chat_chunk(self, index: int, delta: dict[str, Any],
                    usage_of: Sequence[dict[str, int]] | None) -> dict[str, Any]:
        body = {**self._header(chunk=True),
                "choices": [{"index": index, "delta": delta, "logprobs": None,
                             "finish_reason": None}]}
        if usage_of is not None:
            body["usage"] = usage_of[index]
        return body

    def _header(self, *, chunk: bool) -> dict[str, Any]:
        if self.kind == "completion":
            obj = "text_completion"
        else:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.model}

    def _token(self, token_id: int) -> str:
        if self.tokenizer is None or self.tokens_as_ids:  # vLLM's placeholder
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, index: int, out: RequestOutput, start: int, *, echo: bool
                  ) -> dict[str, Any] | None:
        """The logprobs of output tokens `start`.., led (`echo`, completions' echo with
        logprobs) by the prompt's tokens: the first with null entries, as OpenAI and vLLM."""
        c = out.outputs[0]
        pairs: list[tuple[int, dict[int, Logprob] | None]] = []
        if echo and self.echo_logprobs is not None:
            pairs += ((t, None if e is None else _cap(t, e, self.echo_logprobs)) for t, e in
                      zip(out.prompt_token_ids, out.prompt_logprobs or (), strict=False))
        if c.logprobs is not None and not self.echo_only:
            pairs += zip(c.token_ids[start:len(c.logprobs)], c.logprobs[start:], strict=False)
        elif not pairs:
            return None
        if self.kind == "chat":
            return {"content": [self._chat_entry(t, e) for t, e in pairs if e is not None]}
        sent = self._sent_of(index)
        tokens, token_lps, tops, offsets = [], [], [], []
        for t, e in pairs:
            tokens.append(self._token(t))
            token_lps.append(None if e is None else _finite(_sampled(t, e).logprob))
            tops.append(None if e is None else {self._token(i): _finite(lp.logprob)
                                                for i, lp in _top(e)})
            offsets.append(sent.text_offset)
            sent.text_offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _chat_entry(self, token_id: int, entry: dict[int, Logprob]) -> dict[str, Any]:
        def one(tid: int, lp: Logprob) -> dict[str, Any]:
            s = self._token(tid)
            return {"token": s, "logprob": _finite(lp.logprob), "bytes": list(s.encode("utf-8"))}

        return {**one(token_id, _sampled(token_id, entry)),
                "top_logprobs": [one(i, lp) for i, lp in _top(entry)[:self.top_logprobs]]}


def _finite(logprob: float) -> float:
    # JSON has no -inf; vLLM reports masked-out tokens as -9999.0 too.
    return logprob if logprob > -9999.0 else -9999.0  # NaN compares false: also -9999.0


def _sampled(token_id: int, entry: dict[int, Logprob]) -> Logprob:
    return entry.get(token_id) or Logprob(-9999.0)


def _cap(token_id: int, entry: dict[int, Logprob], n: int) -> dict[int, Logprob]:
    """The token's own entry and the `n` best: at most n + 1, as a completion's top list."""
    return {i: lp for i, lp in entry.items()
            if i == token_id or (lp.rank is not None and lp.rank <= n)}


def _top(entry: dict[int, Logprob]) -> Sequence[tuple[int, Logprob]]:
    ranked = [(i, lp) for i, lp in entry.items() if lp.rank is not None]
    return sorted(ranked, key=lambda item: item[1].rank or 0)


def prompt_logprobs_json(out: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` in a response: per prompt token null (the first) or {token id
    (a string): {"logprob", "rank", "decoded_token"}}, -inf as -9999.0."""
    if out.prompt_logprobs is None:
        return None
    return [None if e is None else {
        str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                 "decoded_token": lp.decoded_token} for t, lp in e.items()}
        for e in out.prompt_logprobs]


def usage(prompt_tokens: int, outs: Sequence[RequestOutput]) -> dict[str, int]:
    """Token counts: `prompt_tokens`, and every choice's generated tokens (vLLM's: echo with
    max_tokens 0 counts the one token it generates and does not show)."""
    completion = sum(len(out.outputs[0].token_ids) for out in outs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def usage_of_choice(out: RequestOutput) -> dict[str, int]:
    """One choice's counts so far: its prompt and its completion (continuous_usage_stats)."""
    return usage(len(out.prompt_token_ids), [out])
