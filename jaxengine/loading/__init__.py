"""Weight loading: HF directories (safetensors), GGUF files, the embedded default model, and
PEFT LoRA adapters."""

from jaxengine.loading.load import (
    default_model_path,
    load_gguf,
    load_hf_dir,
    load_model,
    load_tokenizer,
    tiny_model_path,
)
from jaxengine.loading.lora import LoRAAdapter, load_peft_adapter
from jaxengine.model.config import ModelLoadError

__all__ = ["LoRAAdapter", "ModelLoadError", "default_model_path", "load_gguf", "load_hf_dir",
           "load_model", "load_peft_adapter", "load_tokenizer", "tiny_model_path"]
