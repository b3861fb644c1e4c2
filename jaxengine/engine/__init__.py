"""The engine: `LLMEngine`'s step loop, its arguments, how one is built, per-request state,
detokenization and the vLLM-shaped outputs."""

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import build_engine
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

__all__ = ["CompletionOutput", "EngineArgs", "LLMEngine", "Logprob", "RequestMetrics",
           "RequestOutput", "build_engine"]
