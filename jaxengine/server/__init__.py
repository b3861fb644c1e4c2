"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over one `LLMEngine`."""

from jaxengine.server.app import build_app
from jaxengine.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    RequestGroup,
    RequestStream,
)
from jaxengine.server.run import serve, served_model_name

__all__ = ["AsyncEngine", "EngineDeadError", "RequestGroup", "RequestStream", "build_app",
           "serve", "served_model_name"]
