"""jaxengine: a JAX-native LLM serving engine (vLLM-V1 continuous batching on a pure scheduler)."""

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxengine.fixed_batch.generate import GenerateOutput, generate
from jaxengine.fixed_batch.model import load_model_fns, model_fns_of
from jaxengine.fixed_batch.score import ScoreOutput, score
from jaxengine.fixed_batch.text import decode_batch, encode_batch
from jaxengine.llm import LLM
from jaxengine.loading import load_model
from jaxengine.loading.tokenizer import Tokenizer
from jaxengine.model.config import ModelConfig, ModelLoadError
from jaxengine.model.mesh import make_mesh
from jaxengine.runner.distributed import initialize_from_args
from jaxengine.sampling_params import StructuredOutputsParams
from jaxengine.streaming import TextDelta, TextStream, stream, stream_chat
from scheduler import LoRARequest, SamplingParams, SamplingParamsError

__all__ = [
    "LLM", "CompletionOutput", "EngineArgs", "GenerateOutput", "LLMEngine", "LoRARequest",
    "Logprob",
    "RequestMetrics", "RequestOutput", "SamplingParams", "SamplingParamsError",
    "StructuredOutputsParams", "generate",
    "ModelConfig", "ModelLoadError", "TextDelta", "TextStream", "Tokenizer", "load_model",
    "stream", "stream_chat",
    # scale-out: the mesh a model is split over; joining a multi-host runtime first thing
    "initialize_from_args", "make_mesh",
    # generation inside your own jit (jaxengine/fixed_batch/generate.py)
    "ScoreOutput", "decode_batch", "encode_batch", "load_model_fns", "model_fns_of", "score",
]
