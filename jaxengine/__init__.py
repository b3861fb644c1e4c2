"""jaxengine: a JAX-native LLM serving engine (vLLM-V1 continuous batching on a pure scheduler)."""

from jaxengine.config import ModelConfig, ModelLoadError
from jaxengine.engine import LLMEngine
from jaxengine.engine_args import EngineArgs
from jaxengine.generate import GenerateOutput, generate
from jaxengine.llm import LLM
from jaxengine.loading import load_model
from jaxengine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxengine.tokenizer import Tokenizer
from scheduler import SamplingParams

__all__ = [
    "LLM", "CompletionOutput", "EngineArgs", "GenerateOutput", "LLMEngine", "Logprob",
    "RequestMetrics", "RequestOutput", "SamplingParams", "generate",
    "ModelConfig", "ModelLoadError", "Tokenizer", "load_model",
]
