"""Tiny random HF checkpoints for tensor-parallel tests: any head counts, vocabulary and
experts.

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

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM"}


def write_checkpoint(path: str | Path, *, num_heads: int, num_kv_heads: int, vocab_size: int,
                     tie: bool, architecture: str = "llama", num_layers: int = 2,
                     head_dim: int = 8, intermediate_size: int = 64, seed: int = 0,
                     num_experts: int = 0, top_k: int = 2,
                     shared_expert_size: int | None = None,
                     mlp_only_layers: tuple[int, ...] = ()) -> str:
    """Write a random checkpoint of a Llama-family or MoE (mixtral, qwen2_moe: experts of
    width `intermediate_size`, Qwen's dense layers as wide) architecture to `path`
    (created); return the path.

    Weights are N(0, 0.2) (larger than HF's 0.02, so logits are not nearly uniform and the
    greedy choice is well separated), norms near 1.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hidden = num_heads * head_dim
    moe = {}
    if num_experts:
        moe = dict(num_experts=num_experts, num_experts_per_tok=top_k,
                   moe_intermediate_size=intermediate_size,
                   shared_expert_intermediate_size=shared_expert_size,
                   norm_topk_prob=architecture == "mixtral",
                   sparse_layers=tuple(i not in mlp_only_layers for i in range(num_layers)),
                   qkv_bias=architecture == "qwen2_moe")
    cfg = ModelConfig.tiny(architecture, vocab_size=vocab_size, hidden_size=hidden,
                           intermediate_size=intermediate_size, num_layers=num_layers,
                           num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           tie_word_embeddings=tie, **moe)
    rng = np.random.default_rng(seed)
    fam = family(architecture)
    tensors, names = {}, fam.hf_names(cfg)
    for key, shape in model_weight_shapes(cfg).items():
        name, stacked = names[key], key[0] == "layers"
        experts = "{expert}" in name
        for layer in range(shape[0]) if stacked else [None]:
            if stacked and fam.layer_lacks(cfg, key, layer):
                continue
            for expert in range(shape[1]) if experts else [None]:
                one = shape[1 + experts:] if stacked else shape
                transpose = key[-1] == "kernel" or experts
                hf_shape = one[::-1] if transpose else one
                norm = key[-1] == "scale"
                value = 1 + 0.1 * rng.standard_normal(hf_shape) if norm else \
                    0.2 * rng.standard_normal(hf_shape)
                tensors[name.format(layer=layer, expert=expert)] = value.astype(np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "architectures": [ARCHITECTURES[architecture]],
        "model_type": architecture, "hidden_size": hidden, "intermediate_size": intermediate_size,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "num_hidden_layers": num_layers, "head_dim": head_dim, "vocab_size": vocab_size,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": tie, "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32",
    }
    if architecture == "mixtral":
        config |= {"num_local_experts": num_experts, "num_experts_per_tok": top_k,
                   "sliding_window": None}
    elif architecture == "qwen2_moe":
        config |= {"num_experts": num_experts, "num_experts_per_tok": top_k,
                   "moe_intermediate_size": intermediate_size, "norm_topk_prob": False,
                   "shared_expert_intermediate_size": shared_expert_size or 0,
                   "mlp_only_layers": list(mlp_only_layers), "decoder_sparse_step": 1,
                   "qkv_bias": True, "use_sliding_window": False}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return str(path)
