"""The KV cache scales of a checkpoint: per layer, the `k_scale` and `v_scale` an fp8 KV cache
stores k / k_scale and v / v_scale with.

HF fp8 checkpoints (llm-compressor, ModelOpt, AutoFP8) write them as scalars beside each
layer's attention, under one of the names vLLM reads (`maybe_remap_kv_scale_name`):
`self_attn.k_scale` / `v_scale`, `self_attn.attn.k_scale` / `v_scale`,
`self_attn.k_proj.k_scale` / `v_proj.v_scale` or `self_attn.k_proj.output_scale` /
`v_proj.output_scale`. A layer without them gets 1.0, as in vLLM; a checkpoint without any
gets None (`ModelConfig.kv_scales`), and the kernels then use 1.0 everywhere.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxengine.loading.weights import TensorSource
from jaxengine.model.config import ModelConfig, ModelLoadError
from jaxengine.model.families import family

# (k, v) tensor names under a layer's attention prefix ("model.layers.{layer}.self_attn.")
KV_SCALE_NAMES = (("k_scale", "v_scale"), ("attn.k_scale", "attn.v_scale"),
                  ("k_proj.k_scale", "v_proj.v_scale"),
                  ("k_proj.output_scale", "v_proj.output_scale"))
_Q_PROJ = ("layers", "self_attn", "q_proj", "kernel")


def attention_prefix(cfg: ModelConfig) -> str:
    """The checkpoint's name prefix of a layer's attention tensors, `{layer}` in it, as the
    family names its q projection ("model.layers.{layer}.self_attn.")."""
    q_proj = family(cfg.architecture).hf_names(cfg)[_Q_PROJ]
    return q_proj.removesuffix("q_proj.weight")


def read_kv_scales(cfg: ModelConfig, source: TensorSource, *, where: str
                   ) -> tuple[tuple[float, float], ...] | None:
    """Each layer's (k_scale, v_scale) from `source`, 1.0 where a layer has none; None when no
    layer has any.

    Raises:
      ModelLoadError: a scale that is not one positive finite number, naming the tensor.
    """
    prefix = attention_prefix(cfg)
    scales, found = [], False
    for layer in range(cfg.num_layers):
        pair = [1.0, 1.0]
        for names in KV_SCALE_NAMES:
            for i, name in enumerate(names):
                full = prefix.format(layer=layer) + name
                value = source.get(full)
                if value is not None:
                    pair[i], found = _scale(value, f"{where}: {full}"), True
        scales.append((pair[0], pair[1]))
    return tuple(scales) if found else None


def with_kv_scales(cfg: ModelConfig, source: TensorSource, *, where: str) -> ModelConfig:
    """`cfg` with the checkpoint's KV cache scales (`read_kv_scales`)."""
    return dataclasses.replace(cfg, kv_scales=read_kv_scales(cfg, source, where=where))


def _scale(value: np.ndarray, name: str) -> float:
    """One scale tensor (shape () or (1,)) as a positive finite float."""
    flat = np.asarray(value, np.float32).reshape(-1)
    if flat.size != 1 or not (math.isfinite(flat[0]) and flat[0] > 0):
        raise ModelLoadError(f"{name}: a KV cache scale must be one positive finite number, "
                             f"got shape {np.shape(value)} with values {flat[:4].tolist()}")
    return float(flat[0])
