"""The generation endpoints (and /tokenize, /detokenize): validate, prepare, submit to the
`AsyncEngine`, respond.

A request is checked on the event loop (its fields, then `jaxengine.server.limits`), then
prepared in a worker thread: tokenizing, rendering a chat template and fanning out n samples
take time in proportion to the request, and the event loop must go on serving every other
request (and /health) meanwhile. At most `PREPARE_THREADS` requests are prepared at once; the
others wait for a thread, so a burst of large requests holds a bounded amount of memory and
leaves the CPU to the engine loop. (`tokenizers` releases the GIL for most of its work; a Jinja
template holds it, but the interpreter hands it to the event loop every few milliseconds.)

A streamed response is an async generator of server-sent events. When the client goes away,
Starlette cancels that generator; its `finally` aborts the request, which frees its KV blocks
at the next step. A non-streamed request polls for a disconnect while it waits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from jaxengine.engine.outputs import RequestOutput
from jaxengine.engine.parallel_sampling import child_params
from jaxengine.loading.generation_config import diff_sampling_params
from jaxengine.server import tokenization
from jaxengine.server.async_engine import AsyncEngine, EngineDeadError, RequestGroup
from jaxengine.server.chat_protocol import ChatCompletionRequest
from jaxengine.server.errors import error_body, error_response
from jaxengine.server.limits import RequestLimits
from jaxengine.server.models import ServedModels
from jaxengine.server.prompts import (
    EnginePrompt,
    chat_prompt,
    completion_prompts,
    prompt_text,
    truncated,
)
from jaxengine.server.protocol import CompletionRequest, RequestError, resolve_max_tokens
from jaxengine.server.response_bodies import DetokenizeResponse, TokenizeResponse, to_json
from jaxengine.server.responses import (
    ChatFormatter,
    CompletionFormatter,
    Formatter,
    engine_request_ids,
    response_id,
    sse,
    usage,
    usage_of_choice,
)
from jaxengine.server.structured import ToolChoice, structured_outputs_of
from jaxengine.server.tokenization import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from jaxengine.structured.params import StructuredOutputsParams
from scheduler import SamplingParams, SamplingParamsError
from scheduler.request import LoRARequest

logger = logging.getLogger("jaxengine.server")

PREPARE_THREADS = 4  # requests prepared at once (module docstring)
T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class _Choices:
    """A prepared request: one engine request per choice, and what its response needs."""

    children: list[tuple[EnginePrompt, SamplingParams]]  # (prompt, params) per choice
    echo: list[str]  # per choice, the text before its own
    prompt_tokens: int  # the prompts' tokens, each prompt counted once
    structured_outputs: StructuredOutputsParams | None  # the output constraint, to compile
    tool_choice: ToolChoice | None = None  # chat: the output is tool calls


class OpenAIServing:
    """Serves `/v1/completions`, `/v1/chat/completions`, `/tokenize` and `/detokenize` for one
    model and the LoRA adapters served on it (`ServedModels`: a request's `model` picks one).

    A request with n samples (and, for completions, a list of prompts) becomes one engine
    request per choice, all added in one step (`AsyncEngine.add_all`): the n samples of a
    prompt share its prefix-cache blocks, and a seeded request gives sample i the seed
    `seed + i` (vLLM V1's rule), so it is reproducible.
    """

    def __init__(self, engine: AsyncEngine, models: ServedModels, *,
                 trust_request_chat_template: bool = False) -> None:
        """Serve `engine` as `models` names it; render the chat templates requests send only
        if `trust_request_chat_template` (vLLM's flag)."""
        self.engine = engine
        self.models = models
        self.model_name = models.base_model_name
        self.trust_request_chat_template = trust_request_chat_template
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.vocab_size = engine.engine.vocab_size
        self.limits = RequestLimits.of(
            max_model_len=self.max_model_len,
            max_num_seqs=engine.engine.scheduler_config.max_num_seqs, tokenizer=self.tokenizer)
        args = engine.engine.args
        # vLLM's name: what fills the sampling fields a request leaves unset
        self.default_sampling_params = diff_sampling_params(args.model, args.generation_config)
        self._threads = anyio.CapacityLimiter(PREPARE_THREADS)

    def _check(self, body: CompletionRequest | ChatCompletionRequest) -> LoRARequest | None:
        """The checks both endpoints share, text first: the others may echo a field; returns
        the adapter `model` names (None: the base model)."""
        body.check_text()
        lora_request = self.models.lora_request(body.model)
        body.check_supported()
        return lora_request

    def _served_name(self, lora_request: LoRARequest | None) -> str:
        """The `model` a response names: the adapter's, else the base model's (vLLM's)."""
        return self.model_name if lora_request is None else lora_request.lora_name

    async def _prepare(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a worker thread, at most `PREPARE_THREADS` at once."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._threads)

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        """POST /v1/completions."""
        lora_request = self._check(body)
        prompts = body.prompts()
        self.limits.check_choices(body.n, len(prompts))
        self.limits.check_prompts(prompts, truncated=body.truncate_prompt_tokens is not None)
        choices = await self._prepare(self._completion_choices, body)
        await self._compile(choices.structured_outputs, body)
        fmt = CompletionFormatter(
            model=self._served_name(lora_request), tokenizer=self.tokenizer, echo=choices.echo,
            request_id=response_id(CompletionFormatter.ID_PREFIX, _base_id(body, raw)),
            tokens_as_ids=body.return_tokens_as_token_ids,
            prompt_logprobs=body.prompt_logprobs is not None,
            echo_logprobs=body.logprobs if body.echo else None, echo_only=body.echo_only)
        return await self._generate(body, choices, raw, fmt,
                                    with_logprobs=body.logprobs is not None,
                                    lora_request=lora_request)

    def _completion_choices(self, body: CompletionRequest) -> _Choices:
        """Tokenize each prompt and fan it out into n choices (in a worker thread)."""
        so, _ = structured_outputs_of(body)
        children, echo = [], []
        prompts = completion_prompts(body, self.tokenizer, self.vocab_size)
        if body.kv_transfer_params is not None and len(prompts) > 1:
            raise RequestError(f"kv_transfer_params need a single prompt (one request's KV "
                               f"is handed on), got {len(prompts)}", "kv_transfer_params")
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
            for child in child_params(params):
                children.append((prompt, child))
                echo.append(text)
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        return _Choices(children=children, echo=echo, prompt_tokens=prompt_tokens,
                        structured_outputs=so)

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        """POST /v1/chat/completions."""
        lora_request = self._check(body)
        body.check_chat_template(trusted=self.trust_request_chat_template)
        self.limits.check_choices(body.n, 1)
        self.limits.check_text(body.num_chars(), "messages")
        choices = await self._prepare(self._chat_choices, body)
        await self._compile(choices.structured_outputs, body)
        fmt = ChatFormatter(
            model=self._served_name(lora_request), tokenizer=self.tokenizer, echo=choices.echo,
            request_id=response_id(ChatFormatter.ID_PREFIX, _base_id(body, raw)),
            tokens_as_ids=body.return_tokens_as_token_ids,
            prompt_logprobs=body.prompt_logprobs is not None,
            tool_choice=choices.tool_choice, top_logprobs=body.top_logprobs or 0)
        return await self._generate(body, choices, raw, fmt, with_logprobs=body.logprobs,
                                    lora_request=lora_request)

    def _chat_choices(self, body: ChatCompletionRequest) -> _Choices:
        """Render and tokenize the conversation, and fan it out into n choices (in a worker
        thread)."""
        so, tool_choice = structured_outputs_of(body, body.tool_choice, body.tools)
        prompt = truncated(chat_prompt(body, self.tokenizer, self.limits),
                           body.truncate_prompt_tokens, self.tokenizer)
        ids = prompt["prompt_token_ids"]
        max_tokens = resolve_max_tokens(body.requested_max_tokens(), len(ids),
                                        self.max_model_len, prompt_param="messages",
                                        default=self._default_max_tokens)
        params = body.sampling_params(max_tokens, body.num_logprobs(),
                                      self.default_sampling_params, structured_outputs=so,
                                      prompt_logprobs=body.prompt_logprobs)
        children = [(prompt, child) for child in child_params(params)]
        return _Choices(children=children, echo=[body.echo_text()] * len(children),
                        prompt_tokens=len(ids), structured_outputs=so, tool_choice=tool_choice)

    async def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest
                       ) -> TokenizeResponse:
        """vLLM's /tokenize."""
        self.models.lora_request(body.model)  # a 404 for a model not served
        tokenization.check_tokenize(body, self.tokenizer, self.limits,
                                    trusted=self.trust_request_chat_template)
        return await self._prepare(tokenization.tokenize, body, self.tokenizer, self.limits)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's /detokenize."""
        self.models.lora_request(body.model)  # a 404 for a model not served
        return await self._prepare(tokenization.detokenize, body, self.tokenizer)

    async def _compile(self, so: StructuredOutputsParams | None, body: Any) -> None:
        """Compile the request's grammar for the tokenizer before it is queued (off the event
        loop), so a grammar llguidance refuses is a 400; the engine finds it in the cache (an engine
        that compiles only in `add_request` does nothing: `EngineClient.compile_grammar`)."""
        if so is None:
            return
        try:
            await asyncio.to_thread(self.engine.engine.compile_grammar, so)
        except SamplingParamsError as e:  # StructuredOutputsError, or no tokenizer
            raise body.request_error(e) from None

    @property
    def _default_max_tokens(self) -> int | None:
        return self.default_sampling_params.get("max_tokens")

    async def _generate(self, body: Any, choices: _Choices, raw: Request, fmt: Formatter, *,
                        with_logprobs: bool, lora_request: LoRARequest | None) -> Response:
        """Submit one engine request per choice, with `lora_request`'s adapter, and respond
        with `fmt`'s bodies (SSE when `body.stream`)."""
        children = choices.children
        ids = engine_request_ids(fmt.request_id, len(children))
        try:
            group = await self.engine.add_all(
                [(rid, prompt, params) for rid, (prompt, params) in zip(ids, children,
                                                                        strict=True)],
                priority=body.priority, metadata=body.metadata_of_request(),
                lora_request=lora_request)
        except SamplingParamsError as e:  # a limit of this engine (max_logprobs, vocabulary)
            raise body.request_error(e) from None
        except EngineDeadError as e:
            return error_response(str(e), code=e.code)
        if body.stream:
            events = _events(group, fmt, with_logprobs=with_logprobs,
                             prompt_tokens=choices.prompt_tokens,
                             include_usage=body.include_usage,
                             continuous_usage=body.continuous_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            outs = await group.final_all(raw.is_disconnected)
        except EngineDeadError as e:
            return error_response(str(e), code=e.code)
        finally:
            group.abort()  # no-op once finished; frees the blocks if anything went wrong
        if outs is None:  # the client left; nobody reads this
            return Response(status_code=499)
        body_out = fmt.response(outs, with_logprobs=with_logprobs,
                                prompt_tokens=choices.prompt_tokens)
        return Response(to_json(body_out), media_type="application/json")


def _base_id(body: CompletionRequest | ChatCompletionRequest, raw: Request) -> str | None:
    """vLLM's `_base_request_id`: the X-Request-Id header, else the body's request_id."""
    return raw.headers.get("x-request-id") or body.request_id


async def _events(group: RequestGroup, fmt: Formatter, *, with_logprobs: bool,
                  prompt_tokens: int, include_usage: bool, continuous_usage: bool
                  ) -> AsyncIterator[bytes]:
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
        yield sse(error_body(str(e), code=e.code))
        yield sse("[DONE]")
    finally:
        # Reached early when the client disconnected (Starlette cancels this generator) or
        # the body was closed unread: abort, so the KV blocks are freed at the next step.
        group.abort()
