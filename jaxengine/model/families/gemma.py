"""The Gemma family: Gemma 2 and Gemma 3 (text; also the text decoder of a
`Gemma3ForConditionalGeneration` checkpoint, its vision tower not loaded).

Its block wraps attention and the MLP each in a pre- and a post-norm; norms scale by (1 + w) in
float32, embeddings are multiplied by sqrt(hidden_size), the MLP is GeGLU (tanh GELU), the
softmax scale is `query_pre_attn_scalar ** -0.5`. Local (sliding-window) and global layers
alternate as `layer_types` says; Gemma 2 soft-caps attention scores and the final logits,
Gemma 3 has q/k norms and its own RoPE base on local layers.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxengine.model.batch import ModelBatch
from jaxengine.model.config import FULL, SLIDING, ModelConfig
from jaxengine.model.families.family import Family, Get, Path, layer_names, refuse
from jaxengine.model.families.llama import ATTENTION_NAMES, MLP_NAMES, attention, outer_names
from jaxengine.model.layers import MLP, RMSNorm, live_tokens
from jaxengine.model.lora import LayerLoRA
from jaxengine.model.tensor_parallel import TPLayout

logger = logging.getLogger("jaxengine.loading")

NORM_OFFSET = 1.0  # Gemma's RMSNorm scales by (1 + w)
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
         "post_feedforward_layernorm")


class GemmaBlock(nnx.Module):
    """x + post_norm(attention(pre_norm(x))), then x + post_norm(MLP(pre_norm(x)))."""

    def __init__(self, cfg: ModelConfig, layout: TPLayout, *, mesh: Mesh, dtype: jnp.dtype,
                 rngs: nnx.Rngs) -> None:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        for name in NORMS:
            setattr(self, name, RMSNorm(D, eps=eps, dtype=dtype, offset=NORM_OFFSET))
        self.self_attn = attention(cfg, layout, mesh=mesh, dtype=dtype, rngs=rngs,
                                   norm_offset=NORM_OFFSET)
        self.mlp = MLP(D, cfg.intermediate_size, mesh=mesh, dtype=dtype, rngs=rngs,
                       activation=cfg.hidden_act)

    def __call__(self, x: jax.Array, pages: jax.Array, page_offset: jax.Array | int,
                 batch: ModelBatch, cos: jax.Array, sin: jax.Array,
                 layer: jax.Array | int, *, lora: LayerLoRA | None = None, **kernel: Any
                 ) -> tuple[jax.Array, jax.Array]:
        """x [T, D] -> (x [T, D], updated pages); the arguments as `Attention`'s."""
        out, pages = self.self_attn(self.input_layernorm(x), pages, page_offset, batch, cos,
                                    sin, layer, lora=lora, **kernel)
        x = x + self.post_attention_layernorm(out)
        out = self.mlp(self.pre_feedforward_layernorm(x), live_tokens(batch), lora)
        return x + self.post_feedforward_layernorm(out), pages


def _hf_names(cfg: ModelConfig) -> dict[Path, str]:
    names = {**ATTENTION_NAMES, **MLP_NAMES, **{f"{n}.scale": f"{n}.weight" for n in NORMS}}
    return {**outer_names(), **layer_names(names)}


def _hf_fields(get: Get) -> dict[str, Any]:
    model_type = get("model_type")
    act = get("hidden_activation", None) or get("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise refuse("hidden_activation", act, "Gemma's MLP is GeGLU with the tanh GELU "
                     "(gelu_pytorch_tanh)")
    if get("use_bidirectional_attention", False):
        raise refuse("use_bidirectional_attention", True, "the engine decodes causally")
    types = tuple(get("layer_types"))
    fields: dict[str, Any] = dict(
        sliding_window=get("sliding_window"), layer_types=types, hidden_act=act,
        attn_scale=float(get("query_pre_attn_scalar")) ** -0.5,
        attn_softcap=get("attn_logit_softcapping", None),
        final_softcap=get("final_logit_softcapping", None), qk_norm=model_type != "gemma2")
    params = get("rope_parameters")
    if "sliding_attention" in params:  # Gemma 3: local layers have their own RoPE base
        local = params["sliding_attention"]
        if local.get("rope_type", "default") != "default":
            raise refuse("rope_parameters.sliding_attention.rope_type", local["rope_type"],
                         "local layers' RoPE is unscaled")
        fields["rope_local_theta"] = float(local["rope_theta"])
    return fields


# llama.cpp's 27B models (by depth) scale by hidden / heads, as their query_pre_attn_scalar is
_GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gguf_fields(get: Get) -> dict[str, Any]:
    arch = get("general.architecture")
    blocks, window = int(get(f"{arch}.block_count")), get(f"{arch}.attention.sliding_window")
    if arch == "gemma2":  # local and global alternate, the first local
        sliding = [i % 2 == 0 for i in range(blocks)]
        local_theta = None
    else:  # gemma3: a per-layer list, or every `pattern`-th layer global (llama.cpp's 6)
        pattern = get(f"{arch}.attention.sliding_window_pattern", 6)
        sliding = (list(map(bool, pattern)) if isinstance(pattern, list) else
                   [(i + 1) % int(pattern) != 0 for i in range(blocks)])
        local_theta = float(get(f"{arch}.rope.freq_base_swa", 10000.0))
    scalar = get(f"{arch}.attention.key_length")
    if blocks == _GGUF_27B_LAYERS[arch]:
        scalar = get(f"{arch}.embedding_length") / get(f"{arch}.attention.head_count")
    return dict(sliding_window=int(window), hidden_act="gelu_pytorch_tanh",
                layer_types=tuple(SLIDING if s else FULL for s in sliding),
                attn_scale=float(scalar) ** -0.5,
                attn_softcap=get(f"{arch}.attn_logit_softcapping", None),
                final_softcap=get(f"{arch}.final_logit_softcapping", None),
                qk_norm=arch == "gemma3", rope_local_theta=local_theta)


def _text_config(hf: Any) -> Any:
    """Gemma 3's text decoder config; a multimodal checkpoint's vision tower is not loaded."""
    text = getattr(hf, "text_config", None)
    if text is None:
        return hf
    logger.info("%s: loading its text decoder only; the vision tower is ignored",
                type(hf).__name__)
    return text


GEMMA = Family(
    model_types=("gemma2", "gemma3_text", "gemma3"),
    block=GemmaBlock,
    hf_names=_hf_names,
    hf_fields=_hf_fields,
    gguf_archs={"gemma2": "gemma2", "gemma3": "gemma3_text"},
    gguf_fields=_gguf_fields,
    norm_offset=NORM_OFFSET,
    embed_scale=True,
    text_config=_text_config,
)
