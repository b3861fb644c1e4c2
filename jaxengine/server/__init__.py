"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over one `LLMEngine`.

The names below are imported at their first use (PEP 562), not with the package: `serve`
(jaxengine/server/run.py) starts loading the model before FastAPI is imported and imports it on
a thread beside the build, which a package that imported the app first would undo.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module of this package that defines it
_EXPORTS = {"AsyncEngine": "async_engine", "EngineDeadError": "async_engine",
            "RequestGroup": "async_engine", "RequestStream": "async_engine",
            "build_app": "app", "serve": "run", "served_model_name": "run"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
