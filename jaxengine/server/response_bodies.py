"""OpenAI response bodies, vLLM's protocol names: /v1/completions and /v1/chat/completions,
whole and streamed.

Plain dataclasses that pydantic serializes (`to_json`) and documents (/openapi.json), not
validated: the server builds them itself, several per streamed chunk, and validating each as
it is built costs more than writing the chunk's JSON (docs/BENCHMARKS.md §10). A field that
defaults to `MISSING` is left out of the JSON until set; None is null.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

from pydantic import MISSING, TypeAdapter


@functools.cache
def _adapter(cls: type) -> TypeAdapter[Any]:
    return TypeAdapter(cls)


def to_json(body: object) -> bytes:
    """A response body's JSON, as the client gets it."""
    return _adapter(type(body)).dump_json(body)


@dataclasses.dataclass(slots=True, kw_only=True)
class UsageInfo:
    """Token counts of a response or, streamed with continuous usage, of one choice so far."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclasses.dataclass(slots=True, kw_only=True)
class PromptLogprob:
    """vLLM's entry of a prompt token's `prompt_logprobs`: -inf is sent as -9999.0."""

    logprob: float
    rank: int | None
    decoded_token: str | None


# Per prompt token: null (the first, which nothing predicts) or {token id: its entry}.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


@dataclasses.dataclass(slots=True, kw_only=True)
class CompletionLogProbs:
    """OpenAI's legacy logprobs: per token its text, logprob, top alternatives ({text:
    logprob}, the sampled token included) and character offset; the first echoed prompt token
    has null logprob and alternatives."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


@dataclasses.dataclass(slots=True, kw_only=True)
class CompletionResponseChoice:
    """One choice of a whole completions response."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None
    finish_reason: str | None
    stop_reason: int | str | None  # the stop token id or string that ended it (vLLM's)
    # vLLM's, when the request asks for them
    prompt_logprobs: PromptLogprobs | None | MISSING = MISSING


@dataclasses.dataclass(slots=True, kw_only=True)
class CompletionResponse:
    """The body of a /v1/completions response that is not streamed."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    # vLLM's: a prefill instance's handle to the request's KV (docs/DESIGN.md, "Prefill/decode
    # disaggregation"), when it holds it for a decode instance
    kv_transfer_params: dict[str, Any] | None | MISSING = MISSING


@dataclasses.dataclass(slots=True, kw_only=True)
class CompletionResponseStreamChoice:
    """One choice's new text (and logprobs) in a streamed chunk."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclasses.dataclass(slots=True, kw_only=True)
class CompletionStreamResponse:
    """One server-sent event of a streamed /v1/completions response."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | MISSING = MISSING  # the final usage chunk, or continuous usage stats


# ---- /v1/chat/completions ----------------------------------------------------------------


@dataclasses.dataclass(slots=True, kw_only=True)
class FunctionCall:
    """The function a tool call calls, and its arguments: JSON text as generated."""

    name: str
    arguments: str


@dataclasses.dataclass(slots=True, kw_only=True)
class ToolCall:
    """One entry of a reply's `message.tool_calls`."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


@dataclasses.dataclass(slots=True, kw_only=True)
class DeltaFunctionCall:
    """A streamed call's function: its name once, when the call opens, then arguments text."""

    name: str | MISSING = MISSING
    arguments: str


@dataclasses.dataclass(slots=True, kw_only=True)
class DeltaToolCall:
    """A streamed call's piece: the first carries its id, type and name, each later one only
    the arguments' new text; `index` says which call of the reply it belongs to."""

    index: int
    id: str | MISSING = MISSING
    type: Literal["function"] | MISSING = MISSING
    function: DeltaFunctionCall


@dataclasses.dataclass(slots=True, kw_only=True)
class ChatMessage:
    """A whole reply: its text, or its tool calls with null content."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | MISSING = MISSING


@dataclasses.dataclass(slots=True, kw_only=True)
class DeltaMessage:
    """What a streamed chunk adds to a reply: the role (opening chunk), text or tool calls; {}
    when it adds nothing (a chunk that only finishes)."""

    role: Literal["assistant"] | MISSING = MISSING
    content: str | MISSING = MISSING
    tool_calls: list[DeltaToolCall] | MISSING = MISSING


@dataclasses.dataclass(slots=True, kw_only=True)
class ChatCompletionLogProb:
    """A token's text, logprob (-inf sent as -9999.0) and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int]


@dataclasses.dataclass(slots=True, kw_only=True)
class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    """A generated token's logprob and the `top_logprobs` best alternatives."""

    top_logprobs: list[ChatCompletionLogProb]


@dataclasses.dataclass(slots=True, kw_only=True)
class ChatCompletionLogProbs:
    """A choice's logprobs, one entry per generated token."""

    content: list[ChatCompletionLogProbsContent]


@dataclasses.dataclass(slots=True, kw_only=True)
class ChatCompletionResponseChoice:
    """One choice of a whole chat response."""

    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None
    finish_reason: str | None
    stop_reason: int | str | None  # the stop token id or string that ended it (vLLM's)


@dataclasses.dataclass(slots=True, kw_only=True)
class ChatCompletionResponse:
    """The body of a /v1/chat/completions response that is not streamed."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    # vLLM's, when the request asks for them
    prompt_logprobs: PromptLogprobs | None | MISSING = MISSING
    # as CompletionResponse's
    kv_transfer_params: dict[str, Any] | None | MISSING = MISSING


@dataclasses.dataclass(slots=True, kw_only=True)
class ChatCompletionResponseStreamChoice:
    """One choice's delta in a streamed chunk; the opening chunks carry no `stop_reason`."""

    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None
    finish_reason: str | None
    stop_reason: int | str | None | MISSING = MISSING


@dataclasses.dataclass(slots=True, kw_only=True)
class ChatCompletionStreamResponse:
    """One server-sent event of a streamed /v1/chat/completions response."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | MISSING = MISSING  # the final usage chunk, or continuous usage stats


# ---- the other endpoints -----------------------------------------------------------------


@dataclasses.dataclass(slots=True, kw_only=True)
class ModelCard:
    """One entry of /v1/models (vLLM's fields; `owned_by` is this server)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxengine"
    root: str  # the base model's name, an adapter's directory
    parent: str | None = None  # an adapter's base model
    max_model_len: int | None = None  # the base model's (an adapter's is its parent's)


@dataclasses.dataclass(slots=True, kw_only=True)
class ModelList:
    """The body of /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


@dataclasses.dataclass(slots=True, kw_only=True)
class TokenizeResponse:
    """The body of /tokenize (vLLM's): the ids, their count, and the context they must fit."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | MISSING = MISSING  # when `return_token_strs`


@dataclasses.dataclass(slots=True, kw_only=True)
class DetokenizeResponse:
    """The body of /detokenize: the ids' text."""

    prompt: str


@dataclasses.dataclass(slots=True, kw_only=True)
class VersionResponse:
    """The body of /version: this server's version."""

    version: str


@dataclasses.dataclass(slots=True, kw_only=True)
class ErrorInfo:
    """OpenAI's error object: `type` is the `openai` client's exception name for `code`."""

    message: str
    type: str
    param: str | None
    code: int


@dataclasses.dataclass(slots=True, kw_only=True)
class ErrorResponse:
    """The body of every error response, and of the error event that ends a broken stream."""

    error: ErrorInfo
