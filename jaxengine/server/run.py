"""`serve`: build the engine from `EngineArgs`, compile every bucket, then run the app under
uvicorn (so `/health` answers at all only once nothing is left to compile), with the HTTP
settings of `FrontendArgs` (`jaxengine.server.http_server`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.client import EngineClient
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.replicas.data_parallel import build_engines
from jaxengine.replicas.lockstep import LeaderEngine, follow
from jaxengine.runner.distributed import initialize_from_args
from jaxengine.server.args import (
    API_KEY_ENV,
    RUNTIME_LORA_ENVS,
    FrontendArgs,
    LoRAModulePath,
    runtime_lora_updating,
)
from jaxengine.server.warmup import warm_up

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

logger = logging.getLogger("jaxengine.server")


def served_model_name(args: EngineArgs, explicit: str | None = None) -> str:
    """`explicit`, else the model path as given (vLLM's rule), else the default model's name."""
    if explicit:
        return explicit
    return DEFAULT_MODEL_NAME if args.model is None else os.fspath(args.model)


def serve(args: EngineArgs, *, host: str = "127.0.0.1", port: int = 8000,
          model_name: str | None = None, log_interval: float = 10.0,
          log_level: str = "info", headless: bool = False,
          frontend: FrontendArgs | None = None,
          lora_modules: Sequence[LoRAModulePath] = ()) -> None:
    """Load the model, compile every bucket, then serve it until interrupted (blocks).

    The warm-up (`jaxengine.server.warmup`) runs whatever `args.precompile` says, on every
    replica and every process, before uvicorn starts: while it runs nothing listens, and
    afterwards no request compiles. It logs one line per bucket with its time and a summary
    (no progress bars: server output is a log). FastAPI's and uvicorn's imports run on a thread
    beside the model's build, the chat template's tokenizer on one beside the warm-up. Once
    serving ends, the engine is shut down (`shutdown`): programs still to be made in the
    background are not waited for.

    Multi-host (`args.num_processes` > 1, or a cluster JAX detects): every process runs this
    with the same arguments; process 0 serves HTTP and leads, the others pass `headless` and
    follow it step by step (`jaxengine.replicas.lockstep`) until process 0 stops.

    Args:
      args: engine arguments (the model is `args.model`).
      host, port: where to listen.
      model_name: the served model name (default: see `served_model_name`).
      log_interval: seconds between throughput log lines.
      log_level: uvicorn's and jaxengine's log level.
      headless: serve no HTTP; follow process 0 (processes 1 .. N-1 of a multi-host run).
      frontend: the HTTP server's settings (None: the defaults); without an API key, the one
        in $JAXENGINE_API_KEY applies, if set.
      lora_modules: LoRA adapters served from the start (`args.enable_lora` must be set);
        $VLLM_ALLOW_RUNTIME_LORA_UPDATING (or $JAXENGINE_ALLOW_RUNTIME_LORA_UPDATING) "true"
        or "1" also serves `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`.
    Raises:
      ValueError: `headless` on process 0, or not `headless` on another process.
    """
    import jax

    logging.basicConfig(level=log_level.upper(),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    initialize_from_args(args)  # before anything starts a JAX backend
    _check_role(jax.process_index(), jax.process_count(), headless=headless)
    frontend = (frontend or FrontendArgs()).with_env_api_key(os.environ)
    name = served_model_name(args, model_name)
    logger.info("loading %s", name)
    if args.precompile is False:
        logger.info("precompile=False does not apply to serve: it always warms up, so that no "
                    "request compiles after /health is 200")
    t0 = time.perf_counter()
    # the HTTP stack's imports, beside the model's build (whose XLA work leaves the interpreter
    # free part of the time)
    imports = None if headless else _start(_import_http_stack, "serve-imports")
    # Built cold (precompile=False: the engine's own precompile draws a bar), then warmed here.
    # data_parallel_size > 1: replicas behind the router.
    engine = build_engines(dataclasses.replace(args, precompile=False))
    logger.info("loaded in %.1f s; warming up", time.perf_counter() - t0)
    if not headless and engine.tokenizer is not None and engine.tokenizer.chat_template:
        # transformers' tokenizer renders chat templates; a GGUF model's is built at its first
        # use (importing transformers: most of a second), here beside the warm-up, which mostly
        # waits for executables to load, so that no chat request waits for all of it. (Not
        # waited for: /health would wait for it too, measured in docs/BENCHMARKS.md §14.)
        _start(lambda: engine.tokenizer.hf, "chat-template")
    warm_up(engine)
    if imports is not None:
        imports.join()
    logger.info("engine ready: %d replica(s) of %d KV blocks of %d tokens, max_model_len %d; "
                "%.1f s after loading began", args.data_parallel_size,
                engine.scheduler_config.num_blocks, args.block_size, engine.max_model_len,
                time.perf_counter() - t0)
    try:
        if headless:
            _follow(engine)
        elif jax.process_count() > 1:
            _lead(engine, name, host=host, port=port, log_interval=log_interval,
                  log_level=log_level, frontend=frontend, lora_modules=lora_modules)
        else:
            _run_http(engine, name, host=host, port=port, log_interval=log_interval,
                      log_level=log_level, frontend=frontend, lora_modules=lora_modules)
    finally:
        # A stopped server exits now: the background finishes only the program it is making
        # (saved for the next start), rather than making the rest first (minutes when cold).
        engine.shutdown()


def _start(target: Callable[[], object], name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def _import_http_stack() -> None:
    """Import what serving HTTP takes beyond the engine: FastAPI, uvicorn and the app's modules
    (0.3-0.4 s on a 2-core machine, docs/BENCHMARKS.md §14). Not transformers, which an HF
    model's build imports at the same time: its lazy submodules, imported from two threads at
    once, can hand one of them a module still initializing ("cannot import name"). An import
    that fails here (the `serve` extra not installed) fails again, with its message, where
    `_run_http` imports the app."""
    with contextlib.suppress(ImportError):
        import jaxengine.server.app  # noqa: F401
        import jaxengine.server.http_server  # noqa: F401


def _check_role(process: int, processes: int, *, headless: bool) -> None:
    if headless and process == 0:
        raise ValueError("--headless is for processes 1 .. N-1 of a multi-host run; process 0 "
                         "(this one) serves HTTP: drop --headless here")
    if not headless and process > 0:
        raise ValueError(f"this is process {process} of {processes}: only process 0 serves "
                         f"HTTP; run the others with --headless")


def _run_http(engine: EngineClient, name: str, *, host: str, port: int, log_interval: float,
              log_level: str, frontend: FrontendArgs,
              lora_modules: Sequence[LoRAModulePath]) -> None:
    # Here: FastAPI and uvicorn come with the `serve` extra, which `--headless` followers and
    # the offline API do without.
    from jaxengine.server.app import build_app
    from jaxengine.server.http_server import run_uvicorn

    if frontend.api_key is not None:
        logger.info("clients must send the API key (--api-key or $%s) on every route but "
                    "/health, /ping and /metrics", API_KEY_ENV)
    runtime_lora = runtime_lora_updating(os.environ)
    if runtime_lora:  # vLLM's warning
        logger.warning("LoRA dynamic loading & unloading is enabled in the API server ($%s). "
                       "This should ONLY be used for local development!", RUNTIME_LORA_ENVS[0])
    app = build_app(engine, model_name=name, log_interval=log_interval, frontend=frontend,
                    lora_modules=lora_modules, runtime_lora_updating=runtime_lora)
    run_uvicorn(app, host=host, port=port, log_level=log_level, frontend=frontend,
                stop_requests=app.state.stop_engine)


def _lead(engine: LLMEngine, name: str, **http: Any) -> None:
    """Process 0 of a multi-host run: serve HTTP; on the way out, stop the followers."""
    leader = LeaderEngine(engine)
    # _run_http returns after SIGTERM too (see http_server), so the followers hear of it.
    try:
        _run_http(leader, name, **http)
    finally:  # also when uvicorn could not start: the followers must not wait forever
        leader.shutdown()
        logger.info("told the followers to shut down")


def _follow(engine: LLMEngine) -> None:
    """Processes 1 .. N-1: run process 0's steps until it shuts down."""
    logger.info("headless: following process 0")
    steps = follow(engine)
    logger.info("process 0 shut down after %d steps; exiting", steps)
