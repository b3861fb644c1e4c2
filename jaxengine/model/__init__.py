"""The model: its config, the Llama-family decoder and its layers, the device batch, the KV
cache layout, the jit boundary, and `ModelFns` (what runs a model sees of it, fake or real)."""

from jaxengine.model.batch import ModelBatch, RequestChunk, pack_batch
from jaxengine.model.config import ModelConfig, ModelLoadError, RopeScaling
from jaxengine.model.decoder import Model
from jaxengine.model.fns import ModelFns

__all__ = ["Model", "ModelBatch", "ModelConfig", "ModelFns", "ModelLoadError", "RequestChunk",
           "RopeScaling", "pack_batch"]
