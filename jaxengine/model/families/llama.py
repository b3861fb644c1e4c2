"""The Llama family: Llama 2/3 (llama3 RoPE scaling), SmolLM2, Mistral, Qwen2 (q/k/v bias) and
Qwen3 (q/k RMSNorm); a sliding window on every layer (Mistral) or on the layers past
`max_window_layers` (Qwen2 with `use_sliding_window`).

Its block is the pre-norm layer: x + attention(norm(x)), then x + MLP(norm(x)).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxengine.model.batch import ModelBatch
from jaxengine.model.config import ModelConfig
from jaxengine.model.families.family import Family, Get, Path, layer_names, refuse
from jaxengine.model.layers import MLP, Attention, RMSNorm, live_tokens
from jaxengine.model.lora import LayerLoRA
from jaxengine.model.tensor_parallel import TPLayout


def attention(cfg: ModelConfig, layout: TPLayout, *, mesh: Mesh, dtype: jnp.dtype,
              rngs: nnx.Rngs, norm_offset: float = 0.0) -> Attention:
    """A layer's `Attention` as `cfg` describes it (the families' common constructor)."""
    return Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm, eps=cfg.rms_norm_eps,
                     mesh=mesh, dtype=dtype, rngs=rngs, kv_repeat=layout.kv_repeat,
                     sm_scale=cfg.attn_scale, soft_cap=cfg.attn_softcap,
                     norm_offset=norm_offset,
                     windows=cfg.layer_windows if cfg.sliding_window else (),
                     kv_scales=cfg.layer_kv_scales if cfg.kv_scales else ())


class LlamaBlock(nnx.Module):
    """One pre-norm decoder layer: attention then MLP, each added to the residual stream."""

    def __init__(self, cfg: ModelConfig, layout: TPLayout, *, mesh: Mesh, dtype: jnp.dtype,
                 rngs: nnx.Rngs) -> None:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(D, eps=eps, dtype=dtype)
        self.self_attn = attention(cfg, layout, mesh=mesh, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(D, eps=eps, dtype=dtype)
        self.mlp = MLP(D, cfg.intermediate_size, mesh=mesh, dtype=dtype, rngs=rngs,
                       activation=cfg.hidden_act)

    def __call__(self, x: jax.Array, pages: jax.Array, page_offset: jax.Array | int,
                 batch: ModelBatch, cos: jax.Array, sin: jax.Array,
                 layer: jax.Array | int, *, lora: LayerLoRA | None = None, **kernel: Any
                 ) -> tuple[jax.Array, jax.Array]:
        """x [T, D] -> (x [T, D], updated pages); the arguments as `Attention`'s."""
        out, pages = self.self_attn(self.input_layernorm(x), pages, page_offset, batch, cos,
                                    sin, layer, lora=lora, **kernel)
        x = x + out
        return x + self.mlp(self.post_attention_layernorm(x), live_tokens(batch), lora), pages


ATTENTION_NAMES = {f"self_attn.{p}.{kind}": f"self_attn.{p}.{hf}"
                   for p in ("q_proj", "k_proj", "v_proj", "o_proj")
                   for kind, hf in (("kernel", "weight"), ("bias", "bias"))
                   if not (p == "o_proj" and kind == "bias")} | {
    "self_attn.q_norm.scale": "self_attn.q_norm.weight",
    "self_attn.k_norm.scale": "self_attn.k_norm.weight",
}
MLP_NAMES = {f"mlp.{p}.kernel": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}


def outer_names(prefix: str = "model.") -> dict[Path, str]:
    """Embedding, final norm and LM head under the HF names every family here uses."""
    return {("embed_tokens", "embedding"): f"{prefix}embed_tokens.weight",
            ("norm", "scale"): f"{prefix}norm.weight",
            ("lm_head", "kernel"): "lm_head.weight"}


def _hf_names(cfg: ModelConfig) -> dict[Path, str]:
    del cfg  # one table for the whole family
    return {**outer_names(), **layer_names({
        "input_layernorm.scale": "input_layernorm.weight",
        "post_attention_layernorm.scale": "post_attention_layernorm.weight",
        **ATTENTION_NAMES, **MLP_NAMES})}


def _hf_fields(get: Get) -> dict[str, Any]:
    act = get("hidden_act", "silu")
    if act != "silu":
        raise refuse("hidden_act", act, "this family's MLP is SwiGLU (silu)")
    types, model_type = get("layer_types"), get("model_type")
    # Qwen2-MoE writes sliding_window=0 for "none"
    return dict(sliding_window=get("sliding_window") or None,
                layer_types=tuple(types) if types else None,
                qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3")


LLAMA = Family(
    model_types=("llama", "mistral", "qwen2", "qwen3"),
    block=LlamaBlock,
    hf_names=_hf_names,
    hf_fields=_hf_fields,
    # llama.cpp converts Mistral as "llama" (a file that says "mistral" has the same tensors)
    gguf_archs={"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"},
    gguf_permuted=("llama", "mistral"),
)
