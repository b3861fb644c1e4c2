"""vLLM's `/tokenize` and `/detokenize`: their request bodies and responses.

`/tokenize` takes a completion form `{"prompt", "add_special_tokens"?}` or a chat form
`{"messages", "add_generation_prompt"?, "continue_final_message"?, ...}` (the chat template
renders it as `/v1/chat/completions` would) and answers `{"count", "max_model_len", "tokens"}`
(plus `"token_strs"` with `return_token_strs`); `/detokenize` takes `{"tokens"}` and answers
`{"prompt"}`. Unknown fields are 400s naming them, as everywhere in this server, and a prompt
longer than the context could hold is refused before it is tokenized (`jaxengine.server.limits`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from jaxengine.server.chat_protocol import ChatTemplateFields
from jaxengine.server.limits import RequestLimits
from jaxengine.server.prompts import chat_prompt
from jaxengine.server.protocol import (
    RequestError,
    RequestModel,
    has_lone_surrogate,
)
from jaxengine.server.response_bodies import DetokenizeResponse, TokenizeResponse


class TokenizeCompletionRequest(RequestModel):
    """`/tokenize`'s completion form."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's BOS (etc.), as completions add them
    return_token_strs: bool = False  # also each token's string


class TokenizeChatRequest(ChatTemplateFields):
    """`/tokenize`'s chat form: the prompt chat completions would send to the model."""

    model: str | None = None
    return_token_strs: bool = False


class DetokenizeRequest(RequestModel):
    """`/detokenize`'s body."""

    model: str | None = None
    tokens: list[int]


def parse_tokenize(data: Any) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The body as one of the two forms: chat when it has `messages` (vLLM's union).

    Raises:
      RequestValidationError: as FastAPI raises it, so the 400 names the field.
    """
    model = TokenizeChatRequest if isinstance(data, Mapping) and "messages" in data \
        else TokenizeCompletionRequest
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])}
                                      for err in e.errors()]) from None


def check_tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, tokenizer: Any,
                   limits: RequestLimits, *, trusted: bool) -> None:
    """What `/tokenize` checks before tokenizing: valid text, a tokenizer, a chat template only
    if `trusted` (as for chat completions), and `limits`.

    Raises:
      RequestError: naming the field.
    """
    _check_text(body)
    if tokenizer is None:
        raise RequestError("this server has no tokenizer (skip_tokenizer_init): /tokenize is "
                           "unavailable")
    if isinstance(body, TokenizeChatRequest):
        body.check_chat_template(trusted=trusted)
        limits.check_text(body.num_chars(), "messages")
    else:
        limits.check_text(len(body.prompt), "prompt")


def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, tokenizer: Any,
             limits: RequestLimits) -> TokenizeResponse:
    """`/tokenize`'s response (after `check_tokenize`)."""
    if isinstance(body, TokenizeChatRequest):
        ids = chat_prompt(body, tokenizer, limits)["prompt_token_ids"]
    else:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    response = TokenizeResponse(count=len(ids), max_model_len=limits.max_model_len, tokens=ids)
    if body.return_token_strs:
        response.token_strs = [tokenizer.token_str(i) for i in ids]
    return response


def detokenize(body: DetokenizeRequest, tokenizer: Any) -> DetokenizeResponse:
    """`/detokenize`'s response: the ids' text, special tokens included (vLLM's decode)."""
    if tokenizer is None:
        raise RequestError("this server has no tokenizer (skip_tokenizer_init): /detokenize "
                           "is unavailable")
    bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise RequestError(f"tokens must be ids in [0, {tokenizer.vocab_size}); got {bad[:5]}",
                           "tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))


def _check_text(body: BaseModel) -> None:
    for name in type(body).model_fields:
        if has_lone_surrogate(getattr(body, name)):
            raise RequestError(f"'{name}' contains a lone UTF-16 surrogate, which is not valid "
                               f"Unicode text; send valid characters", name)
