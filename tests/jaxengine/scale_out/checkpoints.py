"""Tiny random HF checkpoints for tensor-parallel tests: any head counts and vocabulary.

The fixtures under tests/fixtures/tiny have 4 query heads, which tp=8 cannot split; these are
written on the fly in the same format (config.json + model.safetensors, no tokenizer: the
tests pass token ids with `skip_tokenizer_init=True`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from jaxengine.loading.weights import model_weight_shapes
from jaxengine.model.config import ModelConfig
from jaxengine.model.families import family


def write_checkpoint(path: str | Path, *, num_heads: int, num_kv_heads: int, vocab_size: int,
                     tie: bool, architecture: str = "llama", num_layers: int = 2,
                     head_dim: int = 8, intermediate_size: int = 64, seed: int = 0) -> str:
    """Write a random Llama-family checkpoint to `path` (created); return the path.

    Weights are N(0, 0.2) (larger than HF's 0.02, so logits are not nearly uniform and the
    greedy choice is well separated), norms near 1.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hidden = num_heads * head_dim
    cfg = ModelConfig.tiny(architecture, vocab_size=vocab_size, hidden_size=hidden,
                           intermediate_size=intermediate_size, num_layers=num_layers,
                           num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           tie_word_embeddings=tie)
    rng = np.random.default_rng(seed)
    tensors, names = {}, family(architecture).hf_names(cfg)
    for key, shape in model_weight_shapes(cfg).items():
        name, stacked = names[key], key[0] == "layers"
        for layer in range(shape[0]) if stacked else [None]:
            one = shape[1:] if stacked else shape
            hf_shape = one[::-1] if key[-1] == "kernel" else one
            norm = key[-1] == "scale"
            value = 1 + 0.1 * rng.standard_normal(hf_shape) if norm else \
                0.2 * rng.standard_normal(hf_shape)
            tensors[name.format(layer=layer)] = value.astype(np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}[architecture]],
        "model_type": architecture, "hidden_size": hidden, "intermediate_size": intermediate_size,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "num_hidden_layers": num_layers, "head_dim": head_dim, "vocab_size": vocab_size,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": tie, "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return str(path)
