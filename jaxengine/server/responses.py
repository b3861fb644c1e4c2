"""OpenAI response bodies (completions and chat, whole and streamed) from `RequestOutput`s.

A formatter holds what one request's bodies share (id, creation time, model) and what each
choice has sent so far, so each streamed chunk carries only the new text and logprobs:
`CompletionFormatter` builds the bodies of `jaxengine.server.protocol`, `ChatFormatter` those
of `jaxengine.server.chat_protocol`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import MISSING

from jaxengine.engine.outputs import Logprob, RequestOutput
from jaxengine.server.response_bodies import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    PromptLogprob,
    PromptLogprobs,
    UsageInfo,
    to_json,
)
from jaxengine.server.structured import ToolChoice, arguments_delta, opening_delta
from jaxengine.server.tool_stream import ToolCallStream

# A token and its logprob entry ({token id: Logprob}); None for the first prompt token.
_Pair = tuple[int, dict[int, Logprob] | None]


def response_id(prefix: str, base: str | None) -> str:
    """A response's id: `prefix` (`cmpl-` or `chatcmpl-`, as OpenAI names them), then `base`
    (the client's X-Request-Id or `request_id`, as vLLM uses it) or a random part."""
    return prefix + (base or uuid.uuid4().hex)


def engine_request_ids(response: str, n: int) -> list[str]:
    """The engine's ids of a response's `n` choices: the response's id with a random suffix,
    as vLLM's, so that two clients sending the same id at once both run; then `-i` per
    choice when there are several."""
    unique = f"{response}-{uuid.uuid4().hex[:16]}"
    return [unique] if n == 1 else [f"{unique}-{i}" for i in range(n)]


def sse(data: object) -> bytes:
    """One server-sent event: a response body, or JSON text (an error, "[DONE]")."""
    return b"data: " + (data.encode() if isinstance(data, str) else to_json(data)) + b"\n\n"


@dataclass(slots=True)
class _Sent:
    """What one choice has streamed so far."""

    text: int = 0  # characters of the visible text
    tokens: int = 0  # logprob entries
    text_offset: int = 0  # completions' logprobs.text_offset of the next token
    echoed: bool = False  # its echo (the prompt's text) went out
    tool_call: bool = False  # a named tool's call opened (its id and name went out)
    tool_calls: ToolCallStream = field(default_factory=ToolCallStream)  # "required"'s calls


@dataclass(slots=True, kw_only=True)
class _Formatter:
    """What both endpoints' formatters share: the request, its choices' echo, how tokens are
    shown, and what each choice streamed already.

    Choice i is the i-th request of the group (`RequestGroup.index`): prompt p's n samples are
    choices p*n .. p*n+n-1, as in vLLM.
    """

    ID_PREFIX: ClassVar[str]

    model: str
    tokenizer: Any  # decodes token ids for logprobs (None: ids are shown as "token_id:N")
    request_id: str
    echo: Sequence[str] = ()  # per choice, the text before its own (vLLM's `echo`)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:N" tokens
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field in the response
    created: int = field(default_factory=lambda: int(time.time()))
    sent: dict[int, _Sent] = field(default_factory=dict)

    def first_chunks(self, num_choices: int, *,
                     usage_of: Sequence[UsageInfo] | None = None) -> Sequence[object]:
        """The chunks a stream opens with, before any output (completions: none)."""
        return []

    def _logprobs_due(self, sent: _Sent, out: RequestOutput, with_logprobs: bool) -> bool:
        """Whether a chunk carries logprobs: new ones, or the echoed prompt's (completions:
        they lead the first chunk, with its text, as in vLLM)."""
        c = out.outputs[0]
        new = c.logprobs is not None and len(c.logprobs) > sent.tokens
        return with_logprobs and (new or not sent.echoed)

    def _take(self, index: int, sent: _Sent, out: RequestOutput, text: str) -> str:
        """Mark choice `index`'s output so far sent; the chunk's `text`, after the echo in the
        first chunk (completions: the prompt goes out with the first text)."""
        sent.text = len(out.outputs[0].text)
        if not sent.echoed:
            text, sent.echoed = self._echo(index) + text, True
        return text

    def _sent_of(self, index: int) -> _Sent:
        return self.sent.setdefault(index, _Sent())

    def _echo(self, index: int) -> str:
        return self.echo[index] if index < len(self.echo) else ""

    def _token(self, token_id: int) -> str:
        if self.tokenizer is None or self.tokens_as_ids:  # vLLM's placeholder
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


@dataclass(slots=True, kw_only=True)
class CompletionFormatter(_Formatter):
    """Builds one /v1/completions request's bodies."""

    ID_PREFIX: ClassVar[str] = "cmpl-"

    # echo with logprobs: the prompt's tokens lead, with the request's `logprobs` top entries
    # each (vLLM caps a larger prompt_logprobs there at logprobs + 1)
    echo_logprobs: int | None = None
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone

    def response(self, outs: Sequence[RequestOutput], *, with_logprobs: bool,
                 prompt_tokens: int) -> CompletionResponse:
        """The body that is not streamed (`prompt_tokens`: the prompts' tokens, each prompt
        counted once however many samples it has)."""
        choices = []
        for i, out in enumerate(outs):
            c = out.outputs[0]
            choice = CompletionResponseChoice(
                index=i, text=self._echo(i) + ("" if self.echo_only else c.text),
                logprobs=self._logprobs(i, out, 0, echo=True) if with_logprobs else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            if self.prompt_logprobs:  # vLLM: on each choice
                choice.prompt_logprobs = prompt_logprobs_of(out)
            choices.append(choice)
        body = CompletionResponse(id=self.request_id,
                                  created=self.created, model=self.model, choices=choices,
                                  usage=usage(prompt_tokens, outs))
        if outs[0].kv_transfer_params is not None:  # one prompt, n=1 (the protocol's check)
            body.kv_transfer_params = outs[0].kv_transfer_params
        return body

    def chunk(self, index: int, out: RequestOutput, *, with_logprobs: bool,
              usage_so_far: UsageInfo | None = None) -> CompletionStreamResponse | None:
        """Choice `index`'s chunk for the text (and logprobs) new in `out`; None if there is
        nothing new. `usage_so_far`: added to the chunk (continuous_usage_stats)."""
        c, sent = out.outputs[0], self._sent_of(index)
        text = "" if self.echo_only else c.text[sent.text:]
        logprobs = None
        if self._logprobs_due(sent, out, with_logprobs):
            logprobs = self._logprobs(index, out, sent.tokens, echo=not sent.echoed)
            sent.tokens = len(c.logprobs or ())
        if not text and logprobs is None and not out.finished:
            return None
        text = self._take(index, sent, out, text)
        choice = CompletionResponseStreamChoice(index=index, text=text, logprobs=logprobs,
                                                finish_reason=c.finish_reason,
                                                stop_reason=c.stop_reason)
        body = self._chunk([choice])
        if usage_so_far is not None:
            body.usage = usage_so_far
        return body

    def usage_chunk(self, prompt_tokens: int, outs: Sequence[RequestOutput]
                    ) -> CompletionStreamResponse:
        """The final `stream_options.include_usage` chunk (counts as in `response`)."""
        body = self._chunk([])
        body.usage = usage(prompt_tokens, outs)
        return body

    def _chunk(self, choices: list[CompletionResponseStreamChoice]) -> CompletionStreamResponse:
        return CompletionStreamResponse(id=self.request_id,
                                        created=self.created, model=self.model,
                                        choices=choices)

    def _logprobs(self, index: int, out: RequestOutput, start: int, *, echo: bool
                  ) -> CompletionLogProbs | None:
        """The logprobs of output tokens `start`.., led (`echo`, echo with logprobs) by the
        prompt's tokens: the first with null entries, as OpenAI and vLLM."""
        c = out.outputs[0]
        pairs: list[_Pair] = []
        if echo and self.echo_logprobs is not None:
            pairs += ((t, None if e is None else _cap(t, e, self.echo_logprobs)) for t, e in
                      zip(out.prompt_token_ids, out.prompt_logprobs or (), strict=False))
        if c.logprobs is not None and not self.echo_only:
            pairs += zip(c.token_ids[start:len(c.logprobs)], c.logprobs[start:], strict=False)
        elif not pairs:
            return None
        sent = self._sent_of(index)
        tokens, token_lps, tops, offsets = [], [], [], []
        for t, e in pairs:
            tokens.append(self._token(t))
            token_lps.append(None if e is None else _finite(_sampled(t, e).logprob))
            tops.append(None if e is None else {self._token(i): _finite(lp.logprob)
                                                for i, lp in _top(e)})
            offsets.append(sent.text_offset)
            sent.text_offset += len(tokens[-1])
        return CompletionLogProbs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops,
                                  text_offset=offsets)


@dataclass(slots=True, kw_only=True)
class ChatFormatter(_Formatter):
    """Builds one /v1/chat/completions request's bodies."""

    ID_PREFIX: ClassVar[str] = "chatcmpl-"

    tool_choice: ToolChoice | None = None  # the output is tool calls (structured.py)
    # each token's `top_logprobs` are the n best alone (a completion's top dict also holds the
    # sampled token, up to logprobs + 1 entries, as OpenAI's legacy API and vLLM's)
    top_logprobs: int = 0

    def response(self, outs: Sequence[RequestOutput], *, with_logprobs: bool,
                 prompt_tokens: int) -> ChatCompletionResponse:
        """The body that is not streamed (`prompt_tokens`: the prompt's tokens, counted once
        however many samples it has)."""
        choices = []
        for i, out in enumerate(outs):
            c = out.outputs[0]
            message = self._message(self._echo(i) + c.text)
            reason = c.finish_reason
            if self._required and reason == "stop" and message.tool_calls is not MISSING:
                reason = "tool_calls"  # vLLM's; a named tool's call keeps the engine's reason
            choices.append(ChatCompletionResponseChoice(
                index=i, message=message,
                logprobs=self._logprobs(out, 0) if with_logprobs else None,
                finish_reason=reason, stop_reason=c.stop_reason))
        body = ChatCompletionResponse(id=self.request_id,
                                      created=self.created, model=self.model, choices=choices,
                                      usage=usage(prompt_tokens, outs))
        if self.prompt_logprobs:  # vLLM: on the response
            body.prompt_logprobs = prompt_logprobs_of(outs[0])
        if outs[0].kv_transfer_params is not None:
            body.kv_transfer_params = outs[0].kv_transfer_params
        return body

    def first_chunks(self, num_choices: int, *, usage_of: Sequence[UsageInfo] | None = None
                     ) -> list[ChatCompletionStreamResponse]:
        """The assistant role for each choice, then each choice's echo (vLLM's order).
        `usage_of`: each choice's usage so far (vLLM's continuous_usage_stats)."""
        chunks = [
            self._opening(i, DeltaMessage(role="assistant", content=""), usage_of)
            for i in range(num_choices)]
        for i in range(num_choices):
            if self._echo(i):
                chunks.append(self._opening(i, DeltaMessage(content=self._echo(i)), usage_of))
            self._sent_of(i).echoed = True
        return chunks

    def chunk(self, index: int, out: RequestOutput, *, with_logprobs: bool,
              usage_so_far: UsageInfo | None = None) -> ChatCompletionStreamResponse | None:
        """Choice `index`'s chunk for the text (and logprobs) new in `out`; None if there is
        nothing new. `usage_so_far`: added to the chunk (continuous_usage_stats)."""
        c, sent = out.outputs[0], self._sent_of(index)
        text = c.text[sent.text:]
        logprobs = None
        if self._logprobs_due(sent, out, with_logprobs):
            logprobs = self._logprobs(out, sent.tokens)
            sent.tokens = len(c.logprobs or ())
        if not text and logprobs is None and not out.finished:
            return None
        text = self._take(index, sent, out, text)
        delta = self._delta(sent, text, c.text)
        if delta is None and logprobs is None and not out.finished:
            return None  # "required": nothing of a call complete enough to send yet
        reason = c.finish_reason
        if reason == "stop" and self._required and sent.tool_calls.opened:
            reason = "tool_calls"  # vLLM's, as for the whole response
        choice = ChatCompletionResponseStreamChoice(
            index=index, delta=DeltaMessage() if delta is None else delta, logprobs=logprobs,
            finish_reason=reason, stop_reason=c.stop_reason)
        body = self._chunk([choice])
        if usage_so_far is not None:
            body.usage = usage_so_far
        return body

    def usage_chunk(self, prompt_tokens: int, outs: Sequence[RequestOutput]
                    ) -> ChatCompletionStreamResponse:
        """The final `stream_options.include_usage` chunk (counts as in `response`)."""
        body = self._chunk([])
        body.usage = usage(prompt_tokens, outs)
        return body

    @property
    def _required(self) -> bool:
        return self.tool_choice is not None and self.tool_choice.name is None

    def _message(self, text: str) -> ChatMessage:
        """A reply: its text, or its tool calls (content null) when a tool was asked for and
        the text holds them."""
        calls = None if self.tool_choice is None else self.tool_choice.tool_calls(text)
        if calls is None:
            return ChatMessage(content=text)
        return ChatMessage(content=None, tool_calls=calls)

    def _delta(self, sent: _Sent, text: str, whole: str) -> DeltaMessage | None:
        """A streamed delta (None: nothing to add): text; for a named tool the arguments' new
        text (vLLM's stream: the first delta opens the call with its id and name); for
        "required" the calls' new parts, from the `whole` output so far
        (`jaxengine/server/tool_stream.py`)."""
        if self._required:
            calls = sent.tool_calls.deltas(whole)
            return DeltaMessage(tool_calls=calls) if calls else None
        if not text:
            return None
        if self.tool_choice is None or self.tool_choice.name is None:
            return DeltaMessage(content=text)
        if sent.tool_call:
            return DeltaMessage(tool_calls=[arguments_delta(0, text)])
        sent.tool_call = True
        return DeltaMessage(tool_calls=[opening_delta(0, self.tool_choice.name, text)])

    def _opening(self, index: int, delta: DeltaMessage,
                 usage_of: Sequence[UsageInfo] | None) -> ChatCompletionStreamResponse:
        choice = ChatCompletionResponseStreamChoice(index=index, delta=delta, logprobs=None,
                                                    finish_reason=None)
        body = self._chunk([choice])
        if usage_of is not None:
            body.usage = usage_of[index]
        return body

    def _chunk(self, choices: list[ChatCompletionResponseStreamChoice]
               ) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=self.request_id,
                                            created=self.created, model=self.model,
                                            choices=choices)

    def _logprobs(self, out: RequestOutput, start: int) -> ChatCompletionLogProbs | None:
        """The logprobs of output tokens `start`..; None when the output has none."""
        c = out.outputs[0]
        if c.logprobs is None:
            return None
        return ChatCompletionLogProbs(content=[
            self._entry(t, e) for t, e in zip(c.token_ids[start:len(c.logprobs)],
                                              c.logprobs[start:], strict=False)])

    def _entry(self, token_id: int, entry: dict[int, Logprob]) -> ChatCompletionLogProbsContent:
        token = self._token(token_id)
        return ChatCompletionLogProbsContent(
            token=token, logprob=_finite(_sampled(token_id, entry).logprob),
            bytes=list(token.encode("utf-8")),
            top_logprobs=[self._top_entry(i, lp) for i, lp in _top(entry)[:self.top_logprobs]])

    def _top_entry(self, token_id: int, lp: Logprob) -> ChatCompletionLogProb:
        token = self._token(token_id)
        return ChatCompletionLogProb(token=token, logprob=_finite(lp.logprob),
                                     bytes=list(token.encode("utf-8")))


Formatter = CompletionFormatter | ChatFormatter  # what serving.py streams and responds with


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


def prompt_logprobs_of(out: RequestOutput) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` in a response: per prompt token null (the first) or {token id:
    its logprob, rank and decoded token}, -inf as -9999.0."""
    if out.prompt_logprobs is None:
        return None
    return [None if e is None else {
        t: PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank,
                         decoded_token=lp.decoded_token) for t, lp in e.items()}
        for e in out.prompt_logprobs]


def usage(prompt_tokens: int, outs: Sequence[RequestOutput]) -> UsageInfo:
    """Token counts: `prompt_tokens`, and every choice's generated tokens (vLLM's: echo with
    max_tokens 0 counts the one token it generates and does not show)."""
    completion = sum(len(out.outputs[0].token_ids) for out in outs)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                     total_tokens=prompt_tokens + completion)


def usage_of_choice(out: RequestOutput) -> UsageInfo:
    """One choice's counts so far: its prompt and its completion (continuous_usage_stats)."""
    return usage(len(out.prompt_token_ids), [out])
