"""The two generation endpoints: validate, tokenize, submit to the `AsyncEngine`, respond.

A streamed response is an async generator of server-sent events. When the client goes away,
Starlette cancels that generator; its `finally` aborts the request, which frees its KV blocks
at the next step. A non-streamed request polls for a disconnect while it waits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxengine.engine.outputs import RequestOutput
from jaxengine.loading.generation_config import diff_sampling_params
from jaxengine.server.async_engine import AsyncEngine, EngineDeadError, RequestGroup
from jaxengine.server.chat_protocol import ChatCompletionRequest
from jaxengine.server.errors import error_body, error_response
from jaxengine.server.limits import RequestLimits
from jaxengine.server.prompts import (
    EnginePrompt,
    chat_prompt,
    completion_prompts,
    prompt_text,
    truncated,
)
from jaxengine.server.protocol import (
    CompletionRequest,
    RequestError,
    resolve_max_tokens,
)
from jaxengine.server.responses import Formatter, Kind, random_id, sse, usage, usage_of_choice
from jaxengine.server.structured import ToolChoice, structured_outputs_of
from jaxengine.structured.params import StructuredOutputsParams
from scheduler import SamplingParams, SamplingParamsError

logger = logging.getLogger("jaxengine.server")


class OpenAIServing:
    """Serves `/v1/completions` and `/v1/chat/completions` for one model.

    A request with n samples (and, for completions, a list of prompts) becomes one engine
    request per choice, all added in one step (`AsyncEngine.add_all`): the n samples of a
    prompt share its prefix-cache blocks, and a seeded request gives sample i the seed
    `seed + i` (vLLM V1's rule), so it is reproducible.
    """

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        """Serve `engine` under the name `model_name`."""
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        args = engine.engine.args
        self.limits = RequestLimits(max_n=args.max_num_seqs)
        # vLLM's name: what fills the sampling fields a request leaves unset
        self.default_sampling_params = diff_sampling_params(args.model, args.generation_config)

    def check_model(self, model: str | None) -> None:
        """vLLM's 404 for a `model` this server does not serve (`OpenAIServing._check_model`),
        plus what to send instead."""
        if model is not None and model != self.model_name:
            raise RequestError(f"The model `{model}` does not exist; this server serves "
                               f"`{self.model_name}` (see /v1/models).", "model", code=404)

    def _check(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """The checks both endpoints share, text first: the others may echo a field."""
        body.check_text()
        self.check_model(body.model)
        body.check_supported()

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        """POST /v1/completions."""
        self._check(body)
        self.limits.check_choices(body.n, len(body.prompts()))
        so, _ = structured_outputs_of(body)
        await self._compile(so, body)
        children, echo = [], []
        prompts = completion_prompts(body, self.tokenizer)
        for prompt in prompts:
            # max_tokens defaults to 16 here (OpenAI's and vLLM's), so the model's default
            # max_tokens applies only to an explicit null, as in vLLM. Echo with 0 generates
            # one token (vLLM's), which the response leaves out.
            max_tokens = resolve_max_tokens(1 if body.echo_only else body.max_tokens,
                                            len(prompt["prompt_token_ids"]),
                                            self.max_model_len, prompt_param="prompt",
                                            default=self._default_max_tokens)
            params = body.sampling_params(max_tokens, body.logprobs,
                                          self.default_sampling_params, structured_outputs=so,
                                          prompt_logprobs=body.num_prompt_logprobs())
            text = prompt_text(prompt, self.tokenizer,
                               skip_special_tokens=body.skip_special_tokens) if body.echo else ""
            for child in body.child_params(params):
                children.append((prompt, child))
                echo.append(text)
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        return await self._generate("completion", body, children, raw, echo=echo,
                                    prompt_tokens=prompt_tokens,
                                    with_logprobs=body.logprobs is not None)

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        """POST /v1/chat/completions."""
        self._check(body)
        self.limits.check_choices(body.n, 1)
        so, tool_choice = structured_outputs_of(body, body.tool_choice, body.tools)
        await self._compile(so, body)
        prompt = truncated(chat_prompt(body, self.tokenizer), body.truncate_prompt_tokens,
                           self.tokenizer)
        ids = prompt["prompt_token_ids"]
        max_tokens = resolve_max_tokens(body.requested_max_tokens(), len(ids),
                                        self.max_model_len, prompt_param="messages",
                                        default=self._default_max_tokens)
        params = body.sampling_params(max_tokens, body.num_logprobs(),
                                      self.default_sampling_params, structured_outputs=so,
                                      prompt_logprobs=body.prompt_logprobs)
        children = [(prompt, child) for child in body.child_params(params)]
        return await self._generate("chat", body, children, raw,
                                    echo=[body.echo_text()] * len(children),
                                    prompt_tokens=len(ids), with_logprobs=body.logprobs,
                                    tool_choice=tool_choice)

    async def _compile(self, so: StructuredOutputsParams | None, body: Any) -> None:
        """Compile the request's grammar for the tokenizer before it is queued (off the event
        loop), so a grammar llguidance refuses is a 400; the engine finds it in the cache."""
        engine = self.engine.engine
        if so is None or not hasattr(type(engine), "grammar_compiler"):
            return  # a data-parallel engine: each replica's add_request compiles it
        try:
            await asyncio.to_thread(lambda: engine.grammar_compiler.compile(so))
        except SamplingParamsError as e:  # StructuredOutputsError, or no tokenizer
            raise body.request_error(e) from None

    @property
    def _default_max_tokens(self) -> int | None:
        return self.default_sampling_params.get("max_tokens")

    async def _generate(self, kind: Kind, body: Any,
                        children: Sequence[tuple[EnginePrompt, SamplingParams]], raw: Request, *,
                        echo: Sequence[str], prompt_tokens: int, with_logprobs: bool,
                        tool_choice: ToolChoice | None = None) -> Response:
        """Submit one engine request per choice and respond (SSE when `body.stream`)."""
        # vLLM's `_base_request_id`: the X-Request-Id header, else the body's request_id
        base = raw.headers.get("x-request-id") or body.request_id
        request_id = random_id(kind, base)
        ids = [request_id] if len(children) == 1 else [
            f"{request_id}-{i}" for i in range(len(children))]
        if base is not None and any(self.engine.is_live(r) for r in ids):
            raise RequestError(f"a request with id {base!r} (X-Request-Id or request_id) is "
                               f"running; send a unique one", "request_id")
        try:
            group = await self.engine.add_all(
                [(rid, prompt, params) for rid, (prompt, params) in zip(ids, children,
                                                                        strict=True)],
                priority=body.priority, metadata=body.metadata_of_request())
        except SamplingParamsError as e:  # a limit of this engine (max_logprobs, vocabulary)
            raise body.request_error(e) from None
        except EngineDeadError as e:
            return error_response(str(e), code=503)
        completion = kind == "completion"
        fmt = Formatter(kind, self.model_name, self.tokenizer, request_id, echo=echo,
                        tokens_as_ids=body.return_tokens_as_token_ids, tool_choice=tool_choice,
                        echo_logprobs=body.logprobs if completion and body.echo else None,
                        echo_only=completion and body.echo_only,
                        top_logprobs=0 if completion else body.top_logprobs or 0,
                        prompt_logprobs=body.prompt_logprobs is not None)
        if body.stream:
            events = _events(group, fmt, with_logprobs=with_logprobs, prompt_tokens=prompt_tokens,
                             include_usage=body.include_usage,
                             continuous_usage=body.continuous_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            outs = await group.final_all(raw.is_disconnected)
        except EngineDeadError as e:
            return error_response(str(e), code=500)
        finally:
            group.abort()  # no-op once finished; frees the blocks if anything went wrong
        if outs is None:  # the client left; nobody reads this
            return Response(status_code=499)
        return JSONResponse(fmt.response(outs, with_logprobs=with_logprobs,
                                         prompt_tokens=prompt_tokens))


async def _events(group: RequestGroup, fmt: Formatter, *, with_logprobs: bool,
                  prompt_tokens: int, include_usage: bool, continuous_usage: bool
                  ) -> AsyncIterator[str]:
    """The SSE body of a streamed request; aborts its requests if it is not read to the end."""
    last: dict[int, RequestOutput] = {}
    try:
        n = len(group.request_ids)
        # chat's opening chunks (one prompt): its tokens, nothing generated yet
        opening = [usage(prompt_tokens, [])] * n if continuous_usage else None
        for chunk in fmt.first_chunks(n, usage_of=opening):
            yield sse(chunk)
        async for out in group:
            i = group.index(out.request_id)
            last[i] = out
            chunk = fmt.chunk(i, out, with_logprobs=with_logprobs,
                              usage_so_far=usage_of_choice(out) if continuous_usage else None)
            if chunk is not None:
                yield sse(chunk)
        if include_usage:
            yield sse(fmt.usage_chunk(prompt_tokens, [last[i] for i in sorted(last)]))
        yield sse("[DONE]")
    except EngineDeadError as e:
        yield sse(error_body(str(e), code=500))
        yield sse("[DONE]")
    finally:
        # Reached early when the client disconnected (Starlette cancels this generator) or
        # the body was closed unread: abort, so the KV blocks are freed at the next step.
        group.abort()
