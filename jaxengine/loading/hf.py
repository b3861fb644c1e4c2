"""Load an HF model directory: `config.json` + `*.safetensors` (single or sharded + index)."""

from __future__ import annotations

import json
import os
from contextlib import ExitStack

import numpy as np
from safetensors import safe_open

from jaxengine.model.config import ModelConfig, ModelLoadError


def read_hf_config(path: str) -> ModelConfig:
    """Parse `path/config.json` into a ModelConfig."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{path}: no config.json; pass an HF model directory "
                             "(config.json + *.safetensors) or a .gguf file")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{cfg_path}: unreadable config.json ({e})") from None
    return ModelConfig.from_hf_config(raw)


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


class SafetensorsSource:
    """Tensors of all shards by name, read lazily (memory-mapped) one at a time."""

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
        handle = self._where.get(name)
        return None if handle is None else handle.get_tensor(name)

    def close(self) -> None:
        """Release the shard files."""
        self._stack.close()
