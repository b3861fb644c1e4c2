"""The prefill/decode disaggregation proxy (`jaxengine proxy`): an OpenAI-compatible front that
sends each request to a prefill instance, then to a decode instance with the prefill's KV handle
(docs/DESIGN.md, "Prefill/decode disaggregation"). It talks HTTP to `jaxengine serve` instances
only and holds no engine. Needs the `serve` extra (FastAPI, uvicorn, httpx)."""

from jaxengine.proxy.app import Instance, build_proxy_app, pick, prefill_body, prompt_key
from jaxengine.proxy.prefixes import CHUNK_CHARS, PrefixIndex

__all__ = ["CHUNK_CHARS", "Instance", "PrefixIndex", "build_proxy_app", "pick", "prefill_body",
           "prompt_key"]
