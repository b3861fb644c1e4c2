"""`serve`: build the engine from `EngineArgs` and run the app under uvicorn."""

from __future__ import annotations

import logging
import os

from jaxengine.engine.args import EngineArgs

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

logger = logging.getLogger("jaxengine.server")


def served_model_name(args: EngineArgs, explicit: str | None = None) -> str:
    """`explicit`, else the model path as given (vLLM's rule), else the default model's name."""
    if explicit:
        return explicit
    return DEFAULT_MODEL_NAME if args.model is None else os.fspath(args.model)


def serve(args: EngineArgs, *, host: str = "127.0.0.1", port: int = 8000,
          model_name: str | None = None, log_interval: float = 10.0,
          log_level: str = "info") -> None:
    """Load the model, then serve it until interrupted (blocks).

    Args:
      args: engine arguments (the model is `args.model`).
      host, port: where to listen.
      model_name: the served model name (default: see `served_model_name`).
      log_interval: seconds between throughput log lines.
      log_level: uvicorn's and jaxengine's log level.
    """
    import uvicorn

    from jaxengine.engine.build import build_engine
    from jaxengine.server.app import build_app

    logging.basicConfig(level=log_level.upper(),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    name = served_model_name(args, model_name)
    logger.info("loading %s", name)
    engine = build_engine(args)
    logger.info("engine ready: %d KV blocks of %d tokens, max_model_len %d",
                engine.scheduler_config.num_blocks, args.block_size, engine.max_model_len)
    app = build_app(engine, model_name=name, log_interval=log_interval)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
