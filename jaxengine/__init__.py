"""jaxengine: a JAX-native LLM serving engine (vLLM-V1 continuous batching on a pure scheduler)."""

from jaxengine.engine import LLMEngine
from jaxengine.engine_args import EngineArgs
from jaxengine.llm import LLM
from jaxengine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from scheduler import SamplingParams

__all__ = [
    "LLM", "CompletionOutput", "EngineArgs", "LLMEngine", "Logprob", "RequestMetrics",
    "RequestOutput", "SamplingParams",
]
