"""The FastAPI application over one engine: OpenAI routes, /health, /v1/models, /metrics, and
vLLM's /ping, /version, /tokenize and /detokenize.

`build_app(engine, model_name=...)` takes a built engine (an `EngineClient`: an `LLMEngine`,
a `DataParallelEngine` of several replicas, or a multi-host `LeaderEngine`); the engine loop
starts and stops with the app's lifespan. The lifespan first compiles every bucket of a cold
engine (`jaxengine.server.warmup`): uvicorn opens its socket
only after the lifespan's startup is done, so `/health` is never 200, and no request is taken,
before the engine is warm.
`lora_modules` are the LoRA adapters served from the start, and `runtime_lora_updating` opens
vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (`jaxengine.server.models`).
`frontend` (`FrontendArgs`) adds the edge's middleware (`jaxengine.server.middleware`): the
API key, the body limit, and the echo of `X-Request-Id`.
`app.state.async_engine` is the `AsyncEngine` (tests read the scheduler state through
`app.state.async_engine.engine.snapshot()`), `app.state.serving` the `OpenAIServing` (with
the model's `default_sampling_params`), `app.state.stop_engine` what the lifespan's end
runs (`serve` runs it sooner when a shutdown's drain time is up).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from importlib.metadata import version as package_version
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from jaxengine.engine.client import EngineClient
from jaxengine.server.args import FrontendArgs, LoRAModulePath
from jaxengine.server.async_engine import AsyncEngine
from jaxengine.server.chat_protocol import ChatCompletionRequest
from jaxengine.server.errors import install_error_handlers
from jaxengine.server.middleware import (
    APIKeyMiddleware,
    BodyLimitMiddleware,
    RequestIdHeaderMiddleware,
)
from jaxengine.server.models import (
    LoadLoRAAdapterRequest,
    ServedModels,
    UnloadLoRAAdapterRequest,
)
from jaxengine.server.protocol import CompletionRequest, RequestError
from jaxengine.server.response_bodies import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelList,
    TokenizeResponse,
    VersionResponse,
    to_json,
)
from jaxengine.server.serving import OpenAIServing
from jaxengine.server.tokenization import DetokenizeRequest, parse_tokenize
from jaxengine.server.warmup import warm_up as warm_up_engine

__version__ = package_version("jaxengine")

logger = logging.getLogger("jaxengine.server")


def build_app(engine: EngineClient, *, model_name: str,
              log_interval: float = 10.0, warm_up: bool = True,
              frontend: FrontendArgs | None = None,
              lora_modules: Sequence[LoRAModulePath] = (),
              runtime_lora_updating: bool = False) -> FastAPI:
    """An OpenAI-compatible app serving `engine` as `model_name`.

    Args:
      engine: a built engine; the app owns it from now on.
      model_name: the name clients pass as `model` (and `/v1/models` lists).
      log_interval: seconds between throughput log lines (<= 0: none).
      warm_up: compile every bucket of each cold replica when the app starts, before the
        engine loop (a warm engine costs nothing); False: requests compile what they need,
        stalling the batch when they do (tests that are not about warm-up).
      frontend: the API key, the body limit and whether requests may bring chat templates
        (its timeouts are uvicorn's: `serve` applies them); None: `FrontendArgs()`, no key.
      lora_modules: LoRA adapters to serve under their own names (the engine must be built
        with `enable_lora`); loaded when the app starts, which fails with a `ValueError`
        naming the adapter if one does not load.
      runtime_lora_updating: serve `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`
        (`jaxengine serve` sets it from $VLLM_ALLOW_RUNTIME_LORA_UPDATING); off, they are
        404s that say how to turn them on.
    """
    frontend = FrontendArgs() if frontend is None else frontend
    async_engine = AsyncEngine(engine, model_name=model_name, log_interval=log_interval)
    models = ServedModels(async_engine, model_name, enable_lora=engine.args.enable_lora,
                          runtime_updates=runtime_lora_updating)
    serving = OpenAIServing(async_engine, models,
                            trust_request_chat_template=frontend.trust_request_chat_template)
    created = int(time.time())

    async def stop_engine() -> None:
        """Stop the engine loop; the requests still running end (their streams with an error
        event, then [DONE]). A second call does nothing."""
        if left := async_engine.num_unfinished():
            logger.warning("shutting down: aborting %d request(s) still running", left)
        await async_engine.stop()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if warm_up:  # in a worker thread: the event loop stays free for signals meanwhile
            await asyncio.to_thread(warm_up_engine, engine)
        async_engine.start()
        try:
            await _load_lora_modules(models, lora_modules)
            yield
        finally:
            await stop_engine()

    app = FastAPI(title="jaxengine", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.serving = serving
    app.state.models = models
    app.state.stop_engine = stop_engine
    install_error_handlers(app)
    # The last added runs first: the id is echoed on refusals too, and a request without the
    # key is refused before its size matters.
    app.add_middleware(BodyLimitMiddleware, max_bytes=frontend.max_request_body_bytes)
    if frontend.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=frontend.api_key)
    app.add_middleware(RequestIdHeaderMiddleware)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine loop runs (it starts after the warm-up)."""
        alive = async_engine.is_running()
        return Response(status_code=200 if alive else 503)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> Response:
        """The served model, then the LoRA adapters served on it."""
        return _json(ModelList(data=models.cards(created=created, root=model_name,
                                                 max_model_len=engine.max_model_len)))

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text exposition (an `engine` label per data-parallel replica)."""
        async_engine.refresh_gauges()
        return Response(async_engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # One operation id per method: a route of two methods gives both the same id, which
    # FastAPI warns of while it builds /openapi.json.
    @app.get("/ping", operation_id="ping_get")
    @app.post("/ping", operation_id="ping_post")
    async def ping() -> Response:
        """vLLM's /ping (GET and POST, for load balancers that expect it): /health."""
        return await health()

    @app.get("/version", response_model=VersionResponse)
    async def version() -> Response:
        """The server's version (vLLM answers its own; this is jaxengine's)."""
        return _json(VersionResponse(version=__version__))

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: Annotated[Any, Body()]) -> Response:
        """vLLM's /tokenize: a prompt, or a conversation through the chat template."""
        return _json(await serving.tokenize(parse_tokenize(body)))

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> Response:
        """vLLM's /detokenize: token ids to text."""
        return _json(await serving.detokenize(body))

    # response_model documents the body in /openapi.json; the route returns it already
    # serialized (a JSON Response, or server-sent events of the *StreamResponse chunks).
    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        """OpenAI completions (SSE when `stream`)."""
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        """OpenAI chat completions (SSE when `stream`)."""
        return await serving.chat(body, raw)

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        """vLLM's: serve the adapter at `lora_path` as `lora_name`."""
        models.check_runtime_updates()
        return PlainTextResponse(await models.load(body.lora_name, body.lora_path))

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        """vLLM's: stop serving adapter `lora_name`."""
        models.check_runtime_updates()
        return PlainTextResponse(await models.unload(body.lora_name, body.lora_int_id))

    return app


async def _load_lora_modules(models: ServedModels, modules: Sequence[LoRAModulePath]) -> None:
    """Load the adapters served from the start (vLLM's `init_static_loras`).

    Raises:
      ValueError: one does not load; the message names it and says why.
    """
    for module in modules:
        try:
            await models.load(module.name, module.path, module.base_model_name)
        except RequestError as e:
            raise ValueError(f"--lora-modules {module.name}={module.path}: {e}") from None
        logger.info("serving LoRA adapter %r from %s", module.name, module.path)


def _json(body: object) -> Response:
    """A 200 response of a response body's JSON."""
    return Response(to_json(body), media_type="application/json")
