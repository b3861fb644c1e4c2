"""Load a GGUF file: metadata -> ModelConfig, tensors dequantized one at a time.

`gguf.GGUFReader` memory-maps the file; tensors are found under their HF names through the
`gguf` package's own name map (`gguf.get_tensor_name_map`, the table llama.cpp's converter
uses), and `gguf.quants.dequantize` turns each (Q4_1, Q8_0, F16, ...) into float32 in HF
layout. llama.cpp stores Llama/Mistral/Mixtral Q and K rows permuted for its interleaved RoPE;
`_unpermute` undoes it exactly as transformers' GGUF loader does. llama.cpp stacks a layer's
experts into one tensor per projection (`blk.N.ffn_gate_exps.weight`, [E, F, D]); an expert's
HF name is served as its slice, the stacked tensor dequantized once for all its experts.
`GGUFSource.blocks` gives a quantized tensor's bytes as they are, for `quantization="gguf"`.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Collection, Mapping
from typing import Any

import gguf
import numpy as np

from jaxengine.loading.weights import model_weight_shapes, stacked_tensors
from jaxengine.model.config import ModelConfig, ModelLoadError, RopeScaling
from jaxengine.model.families import GGUF_ARCHS, GGUF_EXPERT_ARCHS, family
from jaxengine_kernels.gguf_blocks import BLOCK_FORMATS, SUPPORTED

# gguf's architecture enum by name; a "mistral" file has llama's tensor names
_GGUF_ENUM = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
_GGUF_ENUM["mistral"] = gguf.MODEL_ARCH.LLAMA
# an expert's HF name, "<layer>.mlp.experts.<e>.gate_proj.weight", around its expert index
_EXPERT = re.compile(r"(?P<stack>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>.*)")
_ROUTER = re.compile(r"blk\.(\d+)\.ffn_gate_inp\.weight")
_FLOAT_TYPES = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                gguf.GGMLQuantizationType.BF16}
_DENSE_FFN = {"gate_proj": gguf.MODEL_TENSOR.FFN_GATE, "up_proj": gguf.MODEL_TENSOR.FFN_UP,
              "down_proj": gguf.MODEL_TENSOR.FFN_DOWN}


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


def gguf_model_type(meta: Mapping[str, Any]) -> str:
    """The model_type of a GGUF file: its architecture's, or, for a file with experts of an
    architecture llama.cpp also writes a MoE family under (Mixtral as "llama"), that family's.

    Raises:
        ModelLoadError: no family reads the architecture.
    """
    arch = str(meta.get("general.architecture", "<missing general.architecture>"))
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: "
                             f"{', '.join(GGUF_ARCHS)}")
    if arch in GGUF_EXPERT_ARCHS and int(meta.get(f"{arch}.expert_count") or 0) > 0:
        return GGUF_EXPERT_ARCHS[arch]
    return GGUF_ARCHS[arch]


def tensor_name_map(cfg: ModelConfig) -> gguf.TensorNameMap:
    """The `gguf` package's HF -> GGUF tensor-name map for `cfg`'s architecture and depth.

    A model with experts also maps a dense layer's MLP to llama.cpp's `blk.N.ffn_{gate,up,
    down}`: llama.cpp names a dense FFN so in every architecture, but gguf's tables for
    qwen2moe/qwen3moe omit it, as llama.cpp runs those all-routed; a mixed stack
    (`mlp_only_layers`, `decoder_sparse_step`) has dense layers among routed ones.
    """
    arch = next(a for a, t in (*GGUF_ARCHS.items(), *GGUF_EXPERT_ARCHS.items())
                if t == cfg.architecture)
    names = gguf.get_tensor_name_map(_GGUF_ENUM[arch], cfg.num_layers)
    if cfg.num_experts:
        for layer in range(cfg.num_layers):
            for proj, tensor in _DENSE_FFN.items():
                names.mapping.setdefault(f"model.layers.{layer}.mlp.{proj}", (
                    tensor, gguf.TENSOR_NAMES[tensor].format(bid=layer)))
    return names


def gguf_tensor_name(names: gguf.TensorNameMap, name: str) -> str | None:
    """The GGUF name of the HF tensor `name` (None if GGUF has no such tensor).

    Args:
        names: from `tensor_name_map`.
        name: e.g. "model.layers.3.self_attn.q_proj.weight" -> "blk.3.attn_q.weight".
    """
    return names.get_name(name, try_suffixes=(".weight", ".bias"))


def _split_expert(name: str) -> tuple[str, int | None]:
    """An HF name -> (the name of the tensor holding it, its expert index or None).

    An expert's weight is held in the stack llama.cpp's converter makes of all a layer's
    experts, under the HF name without the index: "model.layers.0.mlp.experts.3.up_proj.weight"
    -> ("model.layers.0.mlp.experts.up_proj.weight", 3).
    """
    m = _EXPERT.fullmatch(name)
    return (name, None) if m is None else (f"{m['stack']}.{m['proj']}", int(m["expert"]))


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
        self._stack: tuple[str, np.ndarray] | None = None  # the experts' tensor last read
        known = {gguf_tensor_name(self._names, name) for name in self._read_names()}
        unmapped = [t.name for t in reader.tensors if t.name not in known]
        if unmapped:
            raise ModelLoadError(f"{path}: tensor {unmapped[0]} has no place in a "
                                 f"{cfg.architecture} model; the file's architecture or "
                                 "converter is not one this engine reads")

    def _read_names(self) -> set[str]:
        """The HF names of the tensors a model of the config reads (an expert's: its stack)."""
        cfg, fam = self._cfg, self._family
        shapes = model_weight_shapes(cfg)
        return {_split_expert(tensor)[0]
                for path, name in fam.hf_names(cfg).items() if path in shapes
                for tensor in ([name] if path[0] != "layers" else [
                    t for _, _, t in stacked_tensors(
                        name, shapes[path], functools.partial(fam.layer_lacks, cfg, path))])}

    def get(self, name: str) -> np.ndarray | None:
        """The tensor `name` in HF layout as float32, or None if the file lacks it.

        An expert's weight (`...experts.<e>...`) is a slice of its layer's stacked experts,
        which stay dequantized while they are read expert by expert (one stack at a time).
        """
        held, expert = _split_expert(name)
        tensor = self._tensors.get(gguf_tensor_name(self._names, held) or "")
        if tensor is None:
            return None
        arr = self._dequantize(tensor) if expert is None else self._expert(tensor, expert)
        if name.endswith("shared_expert_gate.weight"):
            arr = arr.reshape(1, -1)  # llama.cpp declares it a vector {D}; HF's is [1, D]
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

    def qtype(self, name: str) -> gguf.GGMLQuantizationType | None:
        """The quantized type of tensor `name` (an expert's: its stack's); None if the file
        lacks it or holds it as floats (F32, F16, BF16)."""
        tensor = self._tensors.get(gguf_tensor_name(self._names, _split_expert(name)[0]) or "")
        if tensor is None or tensor.tensor_type in _FLOAT_TYPES:
            return None
        return tensor.tensor_type

    def blocks(self, name: str) -> tuple[gguf.GGMLQuantizationType, np.ndarray] | None:
        """The tensor `name` as the file stores it, if quantized: (its type, its rows of
        blocks u8[out, row_bytes], rows in HF's order); None if the file lacks it or holds it
        as floats (F32, F16, BF16: read those with `get`).

        An expert's rows are its slice of the stacked experts' tensor. Q/K rows permuted by
        llama.cpp are put back in HF's order whole, as `get` does to the float rows.
        Raises:
            ModelLoadError: a quantization type without a jnp dequantizer
                (jaxengine_kernels/gguf_blocks.py); the message names the tensor, the type
                and those supported.
        """
        held, expert = _split_expert(name)
        tensor = self._tensors.get(gguf_tensor_name(self._names, held) or "")
        if tensor is None or tensor.tensor_type in _FLOAT_TYPES:
            return None
        if tensor.tensor_type not in BLOCK_FORMATS:
            raise ModelLoadError(
                f"{self._path}: tensor {tensor.name} is {tensor.tensor_type.name}, which "
                f"quantization='gguf' does not serve from its blocks (supported: {SUPPORTED}; "
                "F32, F16 and BF16 tensors load as floats); load it with quantization=None "
                "to dequantize the file to floats")
        rows = tensor.data if expert is None else tensor.data[expert]
        if self._cfg.architecture in self._family.gguf_permuted:
            if name.endswith("self_attn.q_proj.weight"):
                rows = _unpermute(rows, self._cfg.num_heads)
            elif name.endswith("self_attn.k_proj.weight"):
                rows = _unpermute(rows, self._cfg.num_kv_heads)
        return tensor.tensor_type, np.asarray(rows, np.uint8)

    def _dequantize(self, tensor: Any) -> np.ndarray:
        """A GGUF tensor as float32 in numpy (HF) axis order."""
        try:
            arr = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"{self._path}: tensor {tensor.name} cannot be dequantized "
                                 f"({type(e).__name__}: {e}); the file is corrupt or uses an "
                                 "unsupported quantization") from None
        return arr.reshape(tuple(int(d) for d in reversed(tensor.shape)))

    def _expert(self, tensor: Any, expert: int) -> np.ndarray:
        """Expert `expert` of the stacked experts' tensor [E, ...] -> [...]."""
        if self._stack is None or self._stack[0] != tensor.name:
            self._stack = None  # drop the last stack before dequantizing the next
            self._stack = (tensor.name, self._dequantize(tensor))
        stack = self._stack[1]
        if expert >= stack.shape[0]:
            raise ModelLoadError(f"{self._path}: tensor {tensor.name} holds {stack.shape[0]} "
                                 f"experts, but the config implies {self._cfg.num_experts}")
        return stack[expert]


def read_gguf_config(reader: gguf.GGUFReader, meta: dict[str, Any]) -> ModelConfig:
    """ModelConfig from GGUF metadata and the file's tensors (`gguf_config`)."""
    return gguf_config(meta, [t.name for t in reader.tensors])


def gguf_config(meta: Mapping[str, Any], tensors: Collection[str]) -> ModelConfig:
    """ModelConfig from GGUF metadata and the names of the file's tensors: tied when it has no
    separate output.weight, its routed layers those with a router (`blk.N.ffn_gate_inp.weight`),
    as llama.cpp decides.

    Raises:
        ModelLoadError: as `model_config_from_gguf`, or llama3 RoPE scaling (rope_freqs).
    """
    names = set(tensors)
    if "rope_freqs.weight" in names:
        raise ModelLoadError("GGUF with rope_freqs (llama3 RoPE scaling) is not supported; "
                             "load the HF checkpoint directory instead")
    routed = {int(m[1]) for m in map(_ROUTER.fullmatch, names) if m}
    return model_config_from_gguf(meta, tied="output.weight" not in names, routed=routed)


def model_config_from_gguf(meta: Mapping[str, Any], *, tied: bool,
                           routed: Collection[int] | None = None) -> ModelConfig:
    """Build from GGUF key/value metadata (`general.architecture`, `<arch>.block_count`...).

    Args:
        meta: GGUF fields as plain Python values.
        tied: whether the file lacks a separate `output.weight` (tied embeddings).
        routed: for a model with experts, the layers that route (the rest run a dense MLP);
            None: every layer.
    Raises:
        ModelLoadError: unsupported architecture, or a missing field (named).
    """
    model_type, arch = gguf_model_type(meta), str(meta["general.architecture"])

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
    layers = int(get("block_count"))
    sparse = tuple(routed is None or layer in routed for layer in range(layers))
    if fields.get("num_experts") and not all(sparse):
        fields["sparse_layers"] = sparse
    return ModelConfig(
        architecture=model_type, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=layers, num_heads=heads,
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
