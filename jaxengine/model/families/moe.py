"""Mixture-of-experts families: Mixtral, Qwen2-MoE (with a gated shared expert) and Qwen3-MoE
(q/k norms), whose layers route each token to k of E SwiGLU experts (jaxengine/model/moe.py).

Their block is the Llama pre-norm layer with the MLP replaced by the routed experts. Qwen's
`decoder_sparse_step` and `mlp_only_layers` make some layers dense: a model that mixes both
kinds gives every layer both FFNs (the kind a layer lacks in the checkpoint held as zeros, so
the layers stack for the scan) and runs the one its layer has; a model of one kind has only it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxengine.model.batch import ModelBatch
from jaxengine.model.config import ModelConfig, ModelLoadError
from jaxengine.model.families.family import Family, Get, Path, layer_names, refuse
from jaxengine.model.families.llama import ATTENTION_NAMES, MLP_NAMES, attention, outer_names
from jaxengine.model.layers import MLP, RMSNorm, live_tokens, per_layer
from jaxengine.model.lora import LayerLoRA
from jaxengine.model.moe import SparseMoE
from jaxengine.model.tensor_parallel import TPLayout


class MoEBlock(nnx.Module):
    """One pre-norm decoder layer: attention, then the routed experts (or a dense MLP)."""

    def __init__(self, cfg: ModelConfig, layout: TPLayout, *, mesh: Mesh, dtype: jnp.dtype,
                 rngs: nnx.Rngs) -> None:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.sparse = cfg.layer_sparse
        self.input_layernorm = RMSNorm(D, eps=eps, dtype=dtype)
        self.self_attn = attention(cfg, layout, mesh=mesh, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(D, eps=eps, dtype=dtype)
        self.moe = SparseMoE(
            D, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
            norm_topk_prob=cfg.norm_topk_prob,
            shared_intermediate_size=cfg.shared_expert_intermediate_size,
            expert_parallel=layout.expert_parallel, mesh=mesh, dtype=dtype, rngs=rngs,
        ) if any(self.sparse) else None
        self.mlp = MLP(D, cfg.intermediate_size, mesh=mesh, dtype=dtype,
                       rngs=rngs) if not all(self.sparse) else None

    def __call__(self, x: jax.Array, pages: jax.Array, page_offset: jax.Array | int,
                 batch: ModelBatch, cos: jax.Array, sin: jax.Array,
                 layer: jax.Array | int, *, lora: LayerLoRA | None = None, **kernel: Any
                 ) -> tuple[jax.Array, jax.Array]:
        """x [T, D] -> (x [T, D], updated pages); the arguments as `Attention`'s. Adapters
        apply to the attention only (`jaxengine.model.lora.lora_layout`)."""
        out, pages = self.self_attn(self.input_layernorm(x), pages, page_offset, batch, cos,
                                    sin, layer, lora=lora, **kernel)
        x = x + out
        h, live = self.post_attention_layernorm(x), live_tokens(batch)
        if self.mlp is None or self.moe is None:  # one kind of layer
            ffn = self.moe if self.mlp is None else self.mlp
            return x + ffn(h, live), pages
        sparse = per_layer(self.sparse, layer)
        if isinstance(sparse, bool):
            return x + (self.moe if sparse else self.mlp)(h, live), pages
        out = nnx.cond(sparse, lambda moe, mlp: moe(h, live), lambda moe, mlp: mlp(h, live),
                       self.moe, self.mlp)
        return x + out, pages


def _expert_names(path: str, hf: str, *, prefix: str) -> dict[str, str]:
    return {f"moe.experts.{path}": f"{prefix}.experts.{{expert}}.{hf}.weight"}


def _hf_names(cfg: ModelConfig) -> dict[Path, str]:
    mixtral = cfg.architecture == "mixtral"
    prefix = "block_sparse_moe" if mixtral else "mlp"
    experts = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if mixtral else {
        p: p for p in ("gate_proj", "up_proj", "down_proj")}
    names = {
        "input_layernorm.scale": "input_layernorm.weight",
        "post_attention_layernorm.scale": "post_attention_layernorm.weight",
        **ATTENTION_NAMES, **MLP_NAMES,
        "moe.gate.kernel": f"{prefix}.gate.weight",
        **{f"moe.shared_expert.{p}.kernel": f"mlp.shared_expert.{p}.weight"
           for p in ("gate_proj", "up_proj", "down_proj")},
        "moe.shared_expert_gate.kernel": "mlp.shared_expert_gate.weight",
    }
    for path, hf in experts.items():
        names.update(_expert_names(path, hf, prefix=prefix))
    return {**outer_names(), **layer_names(names)}


def _sparse_layers(num_layers: int, step: int, dense: list[int]) -> tuple[bool, ...]:
    """transformers' rule: layer i is routed unless listed dense, on every `step`-th layer."""
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def _hf_fields(get: Get) -> dict[str, Any]:
    model_type = get("model_type")
    act = get("hidden_act", "silu")
    if act != "silu":
        raise refuse("hidden_act", act, "the experts are SwiGLU (silu)")
    types = get("layer_types")
    fields: dict[str, Any] = dict(
        sliding_window=get("sliding_window") or None,
        layer_types=tuple(types) if types and get("sliding_window") else None,
        num_experts_per_tok=get("num_experts_per_tok"))
    if model_type == "mixtral":
        return fields | dict(num_experts=get("num_local_experts"),
                             moe_intermediate_size=get("intermediate_size"))
    step, dense = get("decoder_sparse_step", 1), list(get("mlp_only_layers", None) or [])
    return fields | dict(
        num_experts=get("num_experts"), moe_intermediate_size=get("moe_intermediate_size"),
        norm_topk_prob=bool(get("norm_topk_prob")),
        shared_expert_intermediate_size=get("shared_expert_intermediate_size", None) or None,
        sparse_layers=_sparse_layers(get("num_hidden_layers"), step, dense),
        qkv_bias=bool(get("qkv_bias", False)), qk_norm=model_type == "qwen3_moe")


def _gguf_fields(get: Get) -> dict[str, Any]:
    """llama.cpp's keys; its graphs renormalise the k weights for Mixtral ("llama") and
    qwen3moe, not for qwen2moe. Which layers are routed the loader reads from the tensors."""
    arch = get("general.architecture")

    def need(key: str) -> Any:
        value = get(f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}; the file is incomplete")
        return value

    experts, used, ff = int(need("expert_count")), int(need("expert_used_count")), int(
        need("feed_forward_length"))
    scale = get(f"{arch}.expert_weights_scale")
    if scale not in (None, 0, 1):  # llama.cpp scales the routing weights by it
        raise refuse(f"{arch}.expert_weights_scale", scale, "routing weights are unscaled")
    if arch == "llama" and get(f"{arch}.expert_shared_feed_forward_length"):
        raise refuse(f"{arch}.expert_shared_feed_forward_length",
                     get(f"{arch}.expert_shared_feed_forward_length"),
                     "a llama-architecture MoE is Mixtral, which has no shared expert")
    # without the key, llama.cpp's own fallbacks: a llama-arch expert is the FFN's width
    width = get(f"{arch}.expert_feed_forward_length") or (ff if arch == "llama" else ff // used)
    fields: dict[str, Any] = dict(num_experts=experts, num_experts_per_tok=used,
                                  moe_intermediate_size=int(width))
    if arch == "llama":
        return fields
    shared = get(f"{arch}.expert_shared_feed_forward_length") or ff
    return fields | dict(
        norm_topk_prob=arch == "qwen3moe",
        shared_expert_intermediate_size=int(shared) if arch == "qwen2moe" else None,
        qkv_bias=arch == "qwen2moe", qk_norm=arch == "qwen3moe")


def _lacks(cfg: ModelConfig, path: Path, layer: int) -> bool:
    """A mixed model's layer has no checkpoint tensors for the FFN kind it does not run."""
    routed = cfg.layer_sparse[layer]
    return (path[1] == "moe" and not routed) or (path[1] == "mlp" and routed)


MOE = Family(
    model_types=("mixtral", "qwen2_moe", "qwen3_moe"),
    block=MoEBlock,
    hf_names=_hf_names,
    hf_fields=_hf_fields,
    gguf_archs={"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"},
    gguf_expert_archs={"llama": "mixtral"},
    gguf_fields=_gguf_fields,
    gguf_permuted=("mixtral",),
    layer_lacks=_lacks,
)
