"""Weight loading: HF directories (safetensors), GGUF files, and the embedded default model."""

from jaxengine.loading.load import (
    default_model_path,
    load_gguf,
    load_hf_dir,
    load_model,
    load_tokenizer,
    tiny_model_path,
)
from jaxengine.model.config import ModelLoadError

__all__ = ["ModelLoadError", "default_model_path", "load_gguf", "load_hf_dir", "load_model",
           "load_tokenizer", "tiny_model_path"]
