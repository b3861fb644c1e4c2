"""Load a GGUF file: metadata -> ModelConfig, tensors dequantized one at a time.

`gguf.GGUFReader` memory-maps the file; tensors are found under their HF names through the
`gguf` package's own name map (`gguf.get_tensor_name_map`, the table llama.cpp's converter
uses), and `gguf.quants.dequantize` turns each (Q4_1, Q8_0, F16, ...) into float32 in HF
layout. llama.cpp stores Llama/Mistral Q and K rows permuted for its interleaved RoPE;
`_unpermute` undoes it exactly as transformers' GGUF loader does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import gguf
import numpy as np

from jaxengine.model.config import ModelConfig, ModelLoadError, RopeScaling
from jaxengine.model.families import GGUF_ARCHS, family

# gguf's architecture enum by name; a "mistral" file has llama's tensor names
_GGUF_ENUM = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
_GGUF_ENUM["mistral"] = gguf.MODEL_ARCH.LLAMA


class _Reader(gguf.GGUFReader):
    """GGUFReader that slices a plain ndarray view of its memory map.

    Slicing an `np.memmap` runs `__array_finalize__` per slice; the reader makes ~250k slices
    for a 49k-token vocabulary, so parsing takes several times longer than with a plain view of
    the same mapped bytes. Same bytes, same results.
    gguf has no public way to do this (its constructor takes only a path and a mode and keeps
    the memmap), so this overrides the private `_get`: pyproject.toml pins gguf to the releases
    where it is as below (0.17.0-0.19.0), and tests/jaxengine/loading/test_gguf_file.py fails
    if its signature changes.
    """

    _plain: np.ndarray | None = None

    def _get(self, offset: int, dtype: Any, count: int = 1,
             override_order: str | None = None) -> np.ndarray:
        if self._plain is None:
            self._plain = self.data.view(np.ndarray)
        dt, count = np.dtype(dtype), int(count)
        arr = self._plain[offset:offset + dt.itemsize * count].view(dt)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr if order == "I" else arr.view(dt.newbyteorder(order))


def open_gguf(path: str) -> gguf.GGUFReader:
    """Open and parse a GGUF file, turning any parse failure into ModelLoadError."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: GGUF file not found")
    try:
        return _Reader(path)
    except Exception as e:  # the reader raises ValueError, struct/numpy errors, ...
        raise ModelLoadError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e}); "
                             "re-download or re-convert it") from None


def gguf_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value fields as Python values (strings, numbers, lists)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception as e:
            raise ModelLoadError(f"GGUF field {key} is corrupt ({e})") from None
    return meta


def tensor_name_map(cfg: ModelConfig) -> gguf.TensorNameMap:
    """The `gguf` package's HF -> GGUF tensor-name map for `cfg`'s architecture and depth."""
    arch = next(a for a, t in GGUF_ARCHS.items() if t == cfg.architecture)
    return gguf.get_tensor_name_map(_GGUF_ENUM[arch], cfg.num_layers)


def gguf_tensor_name(names: gguf.TensorNameMap, name: str) -> str | None:
    """The GGUF name of the HF tensor `name` (None if GGUF has no such tensor).

    Args:
        names: from `tensor_name_map`.
        name: e.g. "model.layers.3.self_attn.q_proj.weight" -> "blk.3.attn_q.weight".
    """
    return names.get_name(name, try_suffixes=(".weight", ".bias"))


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of Q/K rows (transformers' reverse_permute)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


class GGUFSource:
    """GGUF tensors under HF names, dequantized to float32 on request."""

    def __init__(self, reader: gguf.GGUFReader, cfg: ModelConfig, path: str) -> None:
        self._tensors = {t.name: t for t in reader.tensors}
        self._names = tensor_name_map(cfg)
        self._cfg, self._path, self._family = cfg, path, family(cfg.architecture)
        known = {gguf_tensor_name(self._names, name.format(layer=layer))
                 for name in self._family.hf_names(cfg).values()
                 for layer in range(cfg.num_layers)}
        unmapped = [t.name for t in reader.tensors if t.name not in known]
        if unmapped:
            raise ModelLoadError(f"{path}: tensor {unmapped[0]} has no place in a "
                                 f"{cfg.architecture} model; the file's architecture or "
                                 "converter is not one this engine reads")

    def get(self, name: str) -> np.ndarray | None:
        """The tensor `name` in HF layout as float32, or None if the file lacks it."""
        tensor = self._tensors.get(gguf_tensor_name(self._names, name) or "")
        if tensor is None:
            return None
        try:
            arr = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"{self._path}: tensor {tensor.name} cannot be dequantized "
                                 f"({type(e).__name__}: {e}); the file is corrupt or uses an "
                                 "unsupported quantization") from None
        arr = arr.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if self._cfg.architecture in self._family.gguf_permuted:
            if name.endswith("self_attn.q_proj.weight"):
                arr = _unpermute(arr, self._cfg.num_heads)
            elif name.endswith("self_attn.k_proj.weight"):
                arr = _unpermute(arr, self._cfg.num_kv_heads)
        if self._family.norm_offset and "norm" in name:
            # llama.cpp stores a (offset + w) norm with the offset added in (transformers'
            # GGUF loader takes it back out, as here)
            arr = arr - self._family.norm_offset
        return np.asarray(arr, np.float32)


def read_gguf_config(reader: gguf.GGUFReader, meta: dict[str, Any]) -> ModelConfig:
    """ModelConfig from GGUF metadata; tied when the file has no separate output.weight."""
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError("GGUF with rope_freqs (llama3 RoPE scaling) is not supported; "
                             "load the HF checkpoint directory instead")
    return model_config_from_gguf(meta, tied="output.weight" not in names)


def model_config_from_gguf(meta: Mapping[str, Any], *, tied: bool) -> ModelConfig:
    """Build from GGUF key/value metadata (`general.architecture`, `<arch>.block_count`...).

    Args:
        meta: GGUF fields as plain Python values.
        tied: whether the file lacks a separate `output.weight` (tied embeddings).
    Raises:
        ModelLoadError: unsupported architecture, or a missing field (named).
    """
    arch = str(meta.get("general.architecture", "<missing general.architecture>"))
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: "
                             f"{', '.join(GGUF_ARCHS)}")
    model_type = GGUF_ARCHS[arch]

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}; the file is incomplete")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    scaling = None
    if meta.get(f"{arch}.rope.scaling.type", "none") not in ("none", None):
        scaling = RopeScaling(kind=str(get("rope.scaling.type")),
                              factor=float(get("rope.scaling.factor")))
    fields = family(model_type).gguf_fields(lambda key, default=None: meta.get(key, default))
    return ModelConfig(
        architecture=model_type, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")), num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=_f32_value(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32_value(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings=tied, **{"qkv_bias": arch == "qwen2", "qk_norm": arch == "qwen3",
                                     **fields})


def _f32_value(x: Any) -> float:
    # GGUF stores these as float32 (1e-5 reads back as 9.99999974e-06): keep 7 digits.
    return float(f"{float(x):.7g}")
