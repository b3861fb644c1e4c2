"""Load an HF model directory: `config.json` + `*.safetensors` (single or sharded + index).

`config.json` is read by transformers' `AutoConfig` (no torch needed), so config drift is
transformers' to absorb: old top-level `rope_theta` + `rope_scaling` and transformers 5's
`rope_parameters` both arrive as `rope_parameters`, Qwen's `use_sliding_window=False` clears
`sliding_window`, a missing `head_dim` or `num_key_value_heads` gets the class default. What
transformers would fill silently with a 7B model's sizes (a missing `hidden_size`...) is an
error here instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors import safe_open

from jaxengine.model.config import ModelConfig, ModelLoadError, RopeScaling
from jaxengine.model.families import MODEL_TYPES, Family, family
from jaxengine.model.families.family import refuse

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# config.json fields without a meaningful default (transformers' would be Llama-7B's)
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")
# HF fields only some families implement -> the ModelConfig field their reader sets
_FAMILY_ONLY = {"attn_logit_softcapping": "attn_softcap",
                "final_logit_softcapping": "final_softcap",
                "query_pre_attn_scalar": "attn_scale"}


def read_hf_config(path: str | os.PathLike[str]) -> ModelConfig:
    """Parse `path/config.json` into a ModelConfig, through transformers' `AutoConfig`.

    Raises:
        ModelLoadError: no or unreadable config.json, unsupported architecture or feature,
            a missing or invalid field; the message names it.
    """
    path = os.fspath(path)
    cfg_path = os.path.join(path, "config.json")
    raw = _read_config_json(path, cfg_path)
    _refuse_quantized(raw, cfg_path)
    arch = _supported_model_type(raw)
    fam = family(arch)
    text_raw = raw.get("text_config", raw) if fam.text_config else raw
    missing = [name for name in _REQUIRED if text_raw.get(name) is None]
    if missing:
        raise ModelLoadError(f"config.json lacks required field {missing[0]!r}")
    # here, not at the top: transformers takes ~0.7 s to import, and `import jaxengine` and a
    # GGUF model's start do without it (docs/STYLE.md rule 19)
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers and huggingface_hub raise their own error types
        raise ModelLoadError(f"{cfg_path}: transformers cannot read it "
                             f"({type(e).__name__}: {e})") from None
    if fam.text_config:  # the decoder served is the text model, under its own model_type
        hf = fam.text_config(hf)
        arch, fam = hf.model_type, family(hf.model_type)
    return _model_config(hf, arch, fam)


def _refuse_quantized(raw: Mapping[str, Any], cfg_path: str) -> None:
    """Raise for a checkpoint stored quantized (`quantization_config` in config.json, or in
    its text model's): its tensors are not the float weights the loader reads, and a float
    load of them would be silently wrong.

    Raises:
        ModelLoadError: naming the checkpoint's quant_method and what is supported.
    """
    for cfg in (raw, raw.get("text_config") or {}):
        quant = cfg.get("quantization_config")
        if quant is not None:
            method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
            raise ModelLoadError(
                f"{cfg_path}: the checkpoint is quantized (quantization_config quant_method="
                f"{method!r}), which is not supported; use a float checkpoint (float32, "
                f"float16 or bfloat16 safetensors), which quantization='int8' or 'fp8' "
                f"quantizes at load, or a GGUF file")


def _model_config(hf: PretrainedConfig, arch: str, fam: Family) -> ModelConfig:
    """ModelConfig from transformers' parsed (text) config of model_type `arch`: the common
    fields here, the family's own from `fam.hf_fields`.

    Raises:
        ModelLoadError: an unsupported feature (biases, RoPE type, a field of another
            family) or an invalid value.
    """
    if getattr(hf, "mlp_bias", False) or (arch != "qwen2" and getattr(hf, "attention_bias",
                                                                      False)):
        raise ModelLoadError(f"{arch}: mlp_bias / attention_bias=True is not supported")

    def get(name: str, default: object = None) -> object:
        return getattr(hf, name, default)

    fields = fam.hf_fields(get)
    for name, field in _FAMILY_ONLY.items():
        if get(name) is not None and field not in fields:
            raise refuse(name, get(name), f"the {arch} family does not implement it")
    rope = hf.rope_parameters  # transformers >= 5: theta and scaling, old configs included
    rope = rope.get("full_attention", rope)  # keyed by layer type (Gemma 3): global layers'
    return ModelConfig(
        architecture=arch, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads,
        # Qwen2's config class has no head_dim; its model uses hidden // heads, as here
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        rms_norm_eps=float(hf.rms_norm_eps), rope_theta=float(rope["rope_theta"]),
        rope_scaling=_rope_scaling(rope), max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(hf.tie_word_embeddings), **fields)


def _read_config_json(path: str, cfg_path: str) -> dict[str, Any]:
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{path}: no config.json; pass an HF model directory "
                             "(config.json + *.safetensors) or a .gguf file")
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{cfg_path}: unreadable config.json ({e})") from None


def _supported_model_type(raw: Mapping[str, Any]) -> str:
    """The config's model_type if we support it (checked before transformers, which knows
    more architectures than we do and fails on ones it does not know)."""
    arch = str(raw.get("model_type", "")).lower()
    if arch not in MODEL_TYPES:
        names = raw.get("architectures") or [arch or "<no model_type>"]
        raise ModelLoadError(f"unsupported architecture {names[0]!r} (model_type={arch!r}); "
                             f"supported model_type values: {', '.join(MODEL_TYPES)}")
    return arch


def _rope_scaling(rope: Mapping[str, Any]) -> RopeScaling | None:
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return None
    if kind not in ("llama3", "linear"):
        raise ModelLoadError(f"rope scaling type {kind!r} is not supported "
                             "(supported: 'llama3', 'linear', or none)")
    extra = {}
    if kind == "llama3":  # transformers has checked these keys are present
        extra = dict(low_freq_factor=float(rope["low_freq_factor"]),
                     high_freq_factor=float(rope["high_freq_factor"]),
                     original_max_position_embeddings=int(
                         rope["original_max_position_embeddings"]))
    return RopeScaling(kind=kind, factor=float(rope["factor"]), **extra)


def _shard_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights found (only safetensors "
                             "checkpoints are supported)")
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise ModelLoadError(f"{path}: shard(s) {', '.join(missing)} listed in "
                             "model.safetensors.index.json are missing")
    return [os.path.join(path, f) for f in files]


# Where a multimodal checkpoint (Gemma 3) keeps its text decoder's `model.*` tensors:
# transformers 5 writes `model.language_model.*`, older ones `language_model.model.*`.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")


class SafetensorsSource:
    """Tensors of all shards by name, read lazily (memory-mapped) one at a time; a
    multimodal checkpoint's text-decoder tensors are found under their plain names too."""

    def __init__(self, path: str) -> None:
        self._stack = ExitStack()
        self._where: dict[str, object] = {}
        for file in _shard_files(path):
            try:
                handle = self._stack.enter_context(safe_open(file, framework="numpy"))
            except Exception as e:  # safetensors raises its own error types
                self._stack.close()
                raise ModelLoadError(f"{file}: not a readable safetensors file ({e})") from None
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                self._where[key] = handle

    def get(self, name: str) -> np.ndarray | None:
        """The tensor `name`, or None if no shard has it."""
        names = [name]
        if name.startswith("model."):
            names += [prefix + name.removeprefix("model.") for prefix in _TEXT_PREFIXES]
        elif name.startswith("lm_head."):
            names.append("language_model." + name)
        for key in names:
            handle = self._where.get(key)
            if handle is not None:
                return handle.get_tensor(key)
        return None

    def close(self) -> None:
        """Release the shard files."""
        self._stack.close()
