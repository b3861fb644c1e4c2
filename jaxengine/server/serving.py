"""The two generation endpoints: validate, tokenize, submit to the `AsyncEngine`, respond.

A streamed response is an async generator of server-sent events. When the client goes away,
Starlette cancels that generator; its `finally` aborts the request, which frees its KV blocks
at the next step. A non-streamed request polls for a disconnect while it waits.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxengine.loading.generation_config import diff_sampling_params
from jaxengine.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from jaxengine.server.errors import error_body, error_response
from jaxengine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    resolve_max_tokens,
)
from jaxengine.server.responses import Formatter, Kind, random_id, sse
from scheduler import SamplingParamsError

logger = logging.getLogger("jaxengine.server")


class OpenAIServing:
    """Serves `/v1/completions` and `/v1/chat/completions` for one model."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        """Serve `engine` under the name `model_name`."""
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        args = engine.engine.args
        # vLLM's name: what fills the sampling fields a request leaves unset
        self.default_sampling_params = diff_sampling_params(args.model, args.generation_config)

    def _check(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """The checks both endpoints share, text first: the others may echo a field."""
        body.check_text()
        if body.model is not None and body.model != self.model_name:
            # vLLM's 404 (`OpenAIServing._check_model`), plus what to send instead
            raise RequestError(f"The model `{body.model}` does not exist; this server serves "
                               f"`{self.model_name}` (see /v1/models).", "model", code=404)
        body.check_supported()

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        """POST /v1/completions."""
        self._check(body)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            ids = self._encode(prompt)
            engine_prompt: dict[str, Any] = {"prompt": prompt, "prompt_token_ids": ids}
        else:
            ids, engine_prompt = list(prompt), {"prompt_token_ids": list(prompt)}
        # max_tokens defaults to 16 here (OpenAI's and vLLM's), so the model's default
        # max_tokens applies only to an explicit null, as in vLLM.
        max_tokens = resolve_max_tokens(body.max_tokens, len(ids), self.max_model_len,
                                        prompt_param="prompt", default=self._default_max_tokens)
        params = body.sampling_params(max_tokens, body.logprobs, self.default_sampling_params)
        return await self._generate("completion", body, engine_prompt, params, raw,
                                    with_logprobs=body.logprobs is not None)

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        """POST /v1/chat/completions."""
        self._check(body)
        if self.tokenizer is None:
            raise RequestError("this server has no tokenizer: chat is unavailable")
        messages = [m.as_template_message() for m in body.messages]
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise RequestError("the conversation renders to an empty prompt", "messages")
        max_tokens = resolve_max_tokens(body.requested_max_tokens(), len(ids),
                                        self.max_model_len, prompt_param="messages",
                                        default=self._default_max_tokens)
        params = body.sampling_params(max_tokens, body.num_logprobs(),
                                      self.default_sampling_params)
        return await self._generate("chat", body, {"prompt": text, "prompt_token_ids": ids},
                                    params, raw, with_logprobs=body.logprobs)

    @property
    def _default_max_tokens(self) -> int | None:
        return self.default_sampling_params.get("max_tokens")

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("this server has no tokenizer: send token ids as the prompt",
                               "prompt")
        ids = self.tokenizer.encode(text)
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        return ids

    async def _generate(self, kind: Kind, body: Any, prompt: dict[str, Any], params: Any,
                        raw: Request, *, with_logprobs: bool) -> Response:
        request_id = random_id(kind)
        try:
            stream = await self.engine.add(request_id, prompt, params, priority=body.priority,
                                           metadata=body.metadata())
        except SamplingParamsError as e:  # a limit of this engine (max_logprobs, vocabulary)
            raise body.request_error(e) from None
        except EngineDeadError as e:
            return error_response(str(e), code=503)
        fmt = Formatter(kind, self.model_name, self.tokenizer, request_id)
        if body.stream:
            events = _events(stream, fmt, with_logprobs=with_logprobs,
                             include_usage=body.include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            out = await stream.final(raw.is_disconnected)
        except EngineDeadError as e:
            return error_response(str(e), code=500)
        finally:
            stream.abort()  # no-op once finished; frees the blocks if anything went wrong
        if out is None:  # the client left; nobody reads this
            return Response(status_code=499)
        return JSONResponse(fmt.response(out, with_logprobs=with_logprobs))


async def _events(stream: RequestStream, fmt: Formatter, *, with_logprobs: bool,
                  include_usage: bool) -> AsyncIterator[str]:
    """The SSE body of a streamed request; aborts the request if it is not read to the end."""
    last = None
    try:
        first = fmt.first_chunk()
        if first is not None:
            yield sse(first)
        async for out in stream:
            last = out
            chunk = fmt.chunk(out, with_logprobs=with_logprobs)
            if chunk is not None:
                yield sse(chunk)
        if include_usage and last is not None:
            yield sse(fmt.usage_chunk(last))
        yield sse("[DONE]")
    except EngineDeadError as e:
        yield sse(error_body(str(e), code=500))
        yield sse("[DONE]")
    finally:
        # Reached early when the client disconnected (Starlette cancels this generator) or
        # the body was closed unread: abort, so the KV blocks are freed at the next step.
        stream.abort()
