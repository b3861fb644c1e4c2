"""Turn checkpoint tensors (HF names and layouts) into the model's stacked weights.

A source is anything with `get(hf_name) -> np.ndarray | None` (HF safetensors, GGUF). Weights
are converted one name at a time: each stacked array is filled layer by layer in the target
dtype on the host, moved to the device, and dropped, so the host never holds two full copies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.model.config import ModelConfig, ModelLoadError
from jaxengine.model.llama import GLOBAL_WEIGHTS, weight_shapes

# our name -> HF tensor name (per-layer names get the "model.layers.{i}." prefix)
HF_NAMES = {
    "embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
# nn.Linear weights are stored [out, in]; ours are [in, ...out]: transpose, then reshape.
_TRANSPOSED = {"lm_head", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}


class TensorSource(Protocol):
    """Checkpoint tensors by HF name, in HF layout (float or bf16 numpy)."""

    def get(self, name: str) -> np.ndarray | None: ...


def hf_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """The HF checkpoint shape of one tensor (one layer's, for per-layer weights)."""
    ours = weight_shapes(cfg)[name]
    per_layer = ours if name in GLOBAL_WEIGHTS else ours[1:]
    if name not in _TRANSPOSED:
        return (math.prod(per_layer),) if name.startswith("b") else per_layer
    if name == "wo":
        return (cfg.hidden_size, cfg.num_heads * cfg.head_dim)
    return (math.prod(per_layer[1:]), per_layer[0])


def hf_tensor_name(name: str, layer: int | None) -> str:
    """Full HF tensor name of our weight `name` (in `layer` for per-layer weights)."""
    return HF_NAMES[name] if layer is None else f"model.layers.{layer}.{HF_NAMES[name]}"


def _convert(name: str, layer: int | None, arr: np.ndarray, cfg: ModelConfig,
             target: tuple[int, ...], where: str) -> np.ndarray:
    expected = hf_shape(name, cfg)
    if tuple(arr.shape) != expected:
        raise ModelLoadError(f"{where}: tensor {hf_tensor_name(name, layer)} has shape "
                             f"{tuple(arr.shape)}, but the config implies {expected}; the "
                             "weights do not match the config")
    if name in _TRANSPOSED:
        arr = arr.T
    return arr.reshape(target)


def load_weight(name: str, source: TensorSource, cfg: ModelConfig, dtype: jnp.dtype,
                where: str) -> np.ndarray:
    """One of our weights, assembled on the host in `dtype` (layers stacked on axis 0)."""
    shape = weight_shapes(cfg)[name]
    if name in GLOBAL_WEIGHTS:
        arr = _require(source, hf_tensor_name(name, None), where)
        return _convert(name, None, arr, cfg, shape, where).astype(dtype)
    out = np.empty(shape, dtype)
    for layer in range(cfg.num_layers):
        arr = _require(source, hf_tensor_name(name, layer), where)
        out[layer] = _convert(name, layer, arr, cfg, shape[1:], where)
    return out


def _require(source: TensorSource, full_name: str, where: str) -> np.ndarray:
    arr = source.get(full_name)
    if arr is None:
        raise ModelLoadError(f"{where}: tensor {full_name} is missing; the checkpoint is "
                             "incomplete or its architecture does not match config")
    return arr


def load_weights(cfg: ModelConfig, source: TensorSource, *, dtype: jnp.dtype, where: str,
                 put: Callable[[np.ndarray], jax.Array] | None = None) -> dict[str, jax.Array]:
    """All weights of `cfg` as device arrays in `dtype`, converted one name at a time.

    Args:
        cfg: the architecture (decides which tensors exist and their shapes).
        source: checkpoint tensors by HF name.
        dtype: target dtype (float32 or bfloat16).
        where: path shown in error messages.
        put: host -> device transfer (default `jax.device_put`; pass one with a sharding).
    Raises:
        ModelLoadError: a tensor is missing or has the wrong shape.
    """
    put = put or jax.device_put
    np_dtype = jnp.dtype(dtype)
    weights = {}
    for name in weight_shapes(cfg):
        host = load_weight(name, source, cfg, np_dtype, where)
        weights[name] = put(host)
        del host  # the device copy is the only one kept
    return weights
