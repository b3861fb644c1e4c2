"""Map checkpoint tensors (HF names and layouts) into the model's module tree.

The set of weights and their shapes come from the model itself: `load_weights` traces a model
of the config (`nnx.eval_shape`, nothing allocated) and fills each of its parameters, by module
path, from the one table below. A source is anything with `get(hf_name) -> np.ndarray | None`
(HF safetensors, GGUF). Weights are converted one at a time: each stacked array is filled layer
by layer in the target dtype on the host, moved to the device, and dropped, so the host never
holds two full copies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.model.config import ModelConfig, ModelLoadError
from jaxengine.model.llama import Model, Path

# module path (in the scanned layout, where "layers" holds every layer stacked) -> HF tensor
# name; {layer} is the layer index. `kernel`s are nn.Linear weights, stored [out, in] by HF and
# [in, out] by us; every other tensor has the same layout in both. Tensors load in this order.
HF_NAMES: dict[Path, str] = {
    ("embed_tokens", "embedding"): "model.embed_tokens.weight",
    ("norm", "scale"): "model.norm.weight",
    **{("layers", *path.split(".")): f"model.layers.{{layer}}.{hf}" for path, hf in {
        "input_layernorm.scale": "input_layernorm.weight",
        "self_attn.q_proj.kernel": "self_attn.q_proj.weight",
        "self_attn.k_proj.kernel": "self_attn.k_proj.weight",
        "self_attn.v_proj.kernel": "self_attn.v_proj.weight",
        "self_attn.o_proj.kernel": "self_attn.o_proj.weight",
        "post_attention_layernorm.scale": "post_attention_layernorm.weight",
        "mlp.gate_proj.kernel": "mlp.gate_proj.weight",
        "mlp.up_proj.kernel": "mlp.up_proj.weight",
        "mlp.down_proj.kernel": "mlp.down_proj.weight",
        "self_attn.q_proj.bias": "self_attn.q_proj.bias",
        "self_attn.k_proj.bias": "self_attn.k_proj.bias",
        "self_attn.v_proj.bias": "self_attn.v_proj.bias",
        "self_attn.q_norm.scale": "self_attn.q_norm.weight",
        "self_attn.k_norm.scale": "self_attn.k_norm.weight",
    }.items()},
    ("lm_head", "kernel"): "lm_head.weight",
}


class TensorSource(Protocol):
    """Checkpoint tensors by HF name, in HF layout (float or bf16 numpy)."""

    def get(self, name: str) -> np.ndarray | None: ...


def model_weight_shapes(cfg: ModelConfig) -> dict[Path, tuple[int, ...]]:
    """Every weight of a model of `cfg` by module path (scanned layout: layers stacked)."""
    abstract = nnx.eval_shape(lambda: Model(cfg, scan_layers=True))
    return {path: tuple(var.get_value().shape)
            for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}


def _read(source: TensorSource, name: str, transpose: bool, target: tuple[int, ...],
          where: str) -> np.ndarray:
    """One checkpoint tensor in our layout `target`, checked against the shape it implies."""
    arr = source.get(name)
    if arr is None:
        raise ModelLoadError(f"{where}: tensor {name} is missing; the checkpoint is "
                             "incomplete or its architecture does not match config")
    expected = target[::-1] if transpose else target
    if tuple(arr.shape) != expected:
        raise ModelLoadError(f"{where}: tensor {name} has shape {tuple(arr.shape)}, but the "
                             f"config implies {expected}; the weights do not match the config")
    return arr.T if transpose else arr


def load_weight(path: Path, shape: tuple[int, ...], source: TensorSource, dtype: jnp.dtype,
                where: str) -> np.ndarray:
    """The weight at module `path`, assembled on the host in `dtype` (layers on axis 0)."""
    name, transpose = HF_NAMES[path], path[-1] == "kernel"
    if path[0] != "layers":
        return _read(source, name, transpose, shape, where).astype(dtype)
    out = np.empty(shape, dtype)
    for layer in range(shape[0]):
        out[layer] = _read(source, name.format(layer=layer), transpose, shape[1:], where)
    return out


def load_weights(cfg: ModelConfig, source: TensorSource, *, dtype: jnp.dtype, where: str,
                 put: Callable[[np.ndarray], jax.Array] | None = None) -> dict[Path, jax.Array]:
    """All weights of `cfg` as device arrays in `dtype`, by module path, one at a time.

    Args:
        cfg: the architecture (decides which tensors exist and their shapes).
        source: checkpoint tensors by HF name.
        dtype: target dtype (float32 or bfloat16).
        where: path shown in error messages.
        put: host -> device transfer (default `jax.device_put`; pass one with a sharding).
    Returns:
        Arrays by module path in the scanned layout, for `Model(cfg, weights=...)`.
    Raises:
        ModelLoadError: a tensor is missing or has the wrong shape.
    """
    put = put or jax.device_put
    np_dtype = jnp.dtype(dtype)
    shapes = model_weight_shapes(cfg)
    unmapped = shapes.keys() - HF_NAMES.keys()
    if unmapped:  # a module gained a weight the table does not know: a bug here, not user error
        raise RuntimeError(f"no checkpoint name for model weights {sorted(unmapped)}")
    weights = {}
    for path in (p for p in HF_NAMES if p in shapes):
        host = load_weight(path, shapes[path], source, np_dtype, where)
        weights[path] = put(host)
        del host  # the device copy is the only one kept
    return weights
