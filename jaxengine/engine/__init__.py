"""The engine: `LLMEngine`'s step loop, `EngineClient` (what its callers may ask of it), its
arguments, how one is built, per-request state, detokenization, the vLLM-shaped outputs and
the step statistics its stat loggers receive."""

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import build_engine
from jaxengine.engine.client import EngineClient
from jaxengine.engine.inputs import TokenizerLike
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxengine.engine.stats import FinishedRequestStats, IterationStats, StatLogger

__all__ = ["CompletionOutput", "EngineArgs", "EngineClient", "FinishedRequestStats",
           "IterationStats", "LLMEngine", "Logprob", "RequestMetrics", "RequestOutput",
           "StatLogger", "TokenizerLike", "build_engine"]
