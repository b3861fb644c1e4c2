"""The sampling defaults a model recommends in its `generation_config.json`, as vLLM takes them.

vLLM's `--generation-config auto` (its default, and ours: `EngineArgs.generation_config`) reads
the file next to the weights; `ModelConfig.get_diff_sampling_param` keeps six keys of it, and
so do we: `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and `max_new_tokens`
(HF's name for `max_tokens`); every other key of the file (token ids, `do_sample`...) is not a
sampling default in vLLM either. `"vllm"` ignores the file; a directory path reads that
directory's file instead. A GGUF file, and the embedded default model, have none.

Who applies them: `LLM.get_default_sampling_params()` when `generate`/`chat` get no
`sampling_params`, and the HTTP server for each field a request leaves unset.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from jaxengine.model.config import ModelLoadError
from scheduler import SamplingParams, SamplingParamsError

logger = logging.getLogger("jaxengine.loading")

FILE_NAME = "generation_config.json"
# generation_config.json key -> SamplingParams field, for the keys vLLM takes and we implement
TAKEN_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
              "min_p": "min_p", "repetition_penalty": "repetition_penalty",
              "max_new_tokens": "max_tokens"}


def diff_sampling_params(model: str | None, generation_config: str = "auto") -> dict[str, Any]:
    """The model's non-default sampling parameters, by `SamplingParams` field name.

    Args:
      model: the model as `EngineArgs.model` gives it: an HF directory, a .gguf file, or None
        (the embedded default).
      generation_config: "auto" (the model directory's file, if it has one), "vllm" (none),
        or a directory holding a generation_config.json.
    Returns:
      e.g. `{"temperature": 0.6, "top_p": 0.9, "max_tokens": 256}`; empty when there is no
      file or it sets none of the keys we take.
    Raises:
      ModelLoadError: an explicit directory without the file, a file that is not a JSON
        object, or a value `SamplingParams` refuses (the message names the file and key).
    """
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        if model is None or not os.path.isdir(model):
            return {}  # a GGUF file (or the embedded default) carries no generation config
        path = os.path.join(model, FILE_NAME)
        if not os.path.isfile(path):
            return {}
    else:
        path = os.path.join(generation_config, FILE_NAME)
        if not os.path.isfile(path):
            raise ModelLoadError(f"generation_config={generation_config!r}: there is no "
                                 f"{path}; pass a directory holding one, 'auto' (the "
                                 f"model's own) or 'vllm' (none)")
    return _taken(path, _read(path))


def _read(path: str) -> dict[str, Any]:
    # Read as plain JSON, not through transformers' GenerationConfig (docs/STYLE.md rule 18
    # broken on purpose): under transformers 5 its defaults are all None, so its
    # `to_diff_dict()` (what vLLM reads) is the file's own keys, but loading it logs a
    # warning about sampling flags for every model whose file lacks `do_sample`.
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _taken(path: str, raw: dict[str, Any]) -> dict[str, Any]:
    params = {field: raw[key] for key, field in TAKEN_KEYS.items() if raw.get(key) is not None}
    try:
        SamplingParams(**params)
    except SamplingParamsError as e:
        key = next(k for k, field in TAKEN_KEYS.items() if field == e.param)
        raise ModelLoadError(f"{path}: {key}={raw[key]!r} is not a usable default ({e}); fix "
                             f"the file or pass generation_config='vllm'") from None
    if params:
        # vLLM warns the same way: the defaults are not vLLM's neutral ones any more.
        logger.info("default sampling parameters from %s: %s (generation_config='vllm' ignores "
                    "them)", path, params)
    return params
