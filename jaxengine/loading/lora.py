"""Read a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) for a model.

A LoRA adapter adds `scaling * B @ A @ x` to the output of some of a decoder's linear layers.
The adapter's tensors are found by the base model's own checkpoint names (the family's
`hf_names`, jaxengine/model/families): PEFT names the factors of the base weight
`model.layers.{i}.self_attn.q_proj.weight` `base_model.model.model.layers.{i}.self_attn.q_proj.
lora_A.weight` and `...lora_B.weight`, so an adapter reads for every family the engine serves,
a multimodal checkpoint's text decoder included (`model.language_model.layers...`). Every
tensor in the file must land on one of the seven projections the engine adapts; anything else
(an embedding, the LM head, an expert, a vision tower) is refused by name rather than dropped,
since serving an adapter without part of it would silently give other outputs. What PEFT
writes in `adapter_config.json` that changes the maths beyond plain LoRA is refused the same way.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from jaxengine.loading.weights import model_weight_shapes
from jaxengine.model.config import ModelConfig
from jaxengine.model.families import family

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# adapter_config.json fields that change a LoRA layer's forward pass (or the base model) in a
# way the engine does not implement: any true / non-empty value is refused.
_VARIANTS = ("use_dora", "use_qalora", "use_bdlora", "lora_bias", "fan_in_fan_out",
             "modules_to_save", "trainable_token_indices", "target_parameters",
             "layer_replication", "alora_invocation_tokens", "arrow_config", "kasa_config",
             "velora_config", "monteclora_config", "megatron_config")
# Where PEFT's names of a multimodal model's text decoder put `model.` (as hf.SafetensorsSource)
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """A LoRA adapter's weights, stacked by layer, for one base model.

    Attributes:
        name: the adapter's name (the request's `lora_name`).
        rank: r, the factors' inner size (a module of smaller rank is zero-padded to it).
        scaling: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA; a module whose own
            rank or alpha (`rank_pattern`, `alpha_pattern`) gives another scale has the ratio
            folded into its B.
        weights: module -> (A f32[Ly, r, in], B f32[Ly, out, r]) for each module of
            LORA_MODULES the adapter targets; a layer it does not target holds zeros.
    """

    name: str
    rank: int
    scaling: float
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


def load_peft_adapter(path: str | os.PathLike[str], model_config: ModelConfig, *,
                      max_lora_rank: int) -> LoRAAdapter:
    """The PEFT LoRA adapter in directory `path`, checked against the base `model_config`.

    `layers_to_transform` / `layers_pattern` need nothing of their own: the layers an adapter
    leaves alone have no tensors, and hold zeros here.

    Args:
        path: a directory with `adapter_config.json` and `adapter_model.safetensors`.
        model_config: the served model's config (the adapter's base).
        max_lora_rank: the largest rank the engine's adapter slots hold.
    Returns:
        The adapter (named as its directory), its weights float32 numpy on the host.
    Raises:
        ValueError: a missing or unreadable file, a rank above `max_lora_rank`, a PEFT type
            or variant other than plain LoRA, a module the engine does not adapt, or a tensor
            whose shape does not match the base model (an adapter of another base); the
            message names the field or tensor and what to change.
    """
    path = os.fspath(path)
    config = _read_config(path, max_lora_rank)
    weights_file = os.path.join(path, WEIGHTS_FILE)
    factors = _factors(_read_tensors(path), model_config, weights_file)
    r, alpha, rslora = config["r"], config["lora_alpha"], bool(config.get("use_rslora"))
    rank = max([r, *(config.get("rank_pattern") or {}).values()])
    scaling = _scale(alpha, r, rslora)
    shapes = module_shapes(model_config)
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for (module, layer), (module_name, pair) in sorted(factors.items()):
        n_in, n_out = shapes[module]
        r_here = _pattern(config, "rank_pattern", module_name, r)
        a = _checked(pair, "A", (r_here, n_in), module, weights_file)
        b = _checked(pair, "B", (n_out, r_here), module, weights_file)
        scale = _scale(_pattern(config, "alpha_pattern", module_name, alpha), r_here, rslora)
        if module not in weights:
            weights[module] = (np.zeros((model_config.num_layers, rank, n_in), np.float32),
                               np.zeros((model_config.num_layers, n_out, rank), np.float32))
        weights[module][0][layer, :r_here] = a
        weights[module][1][layer, :, :r_here] = b * np.float32(scale / scaling)
    return LoRAAdapter(name=os.path.basename(os.path.normpath(path)), rank=rank,
                       scaling=scaling, weights=weights)


def _read_config(path: str, max_lora_rank: int) -> dict[str, Any]:
    """`adapter_config.json`, checked to be plain LoRA of rank <= `max_lora_rank` on modules
    the engine adapts."""
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter path {path!r} is not a directory; pass a PEFT adapter "
                         f"directory ({CONFIG_FILE} + {WEIGHTS_FILE})")
    where = os.path.join(path, CONFIG_FILE)
    try:
        with open(where) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no {CONFIG_FILE}; a PEFT LoRA adapter directory holds "
                         f"{CONFIG_FILE} and {WEIGHTS_FILE}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: unreadable ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: not a JSON object")
    _check_config(config, where, max_lora_rank)
    return config


def _check_config(config: Mapping[str, Any], where: str, max_lora_rank: int) -> None:
    """Raise for anything in `config` but plain LoRA (scaled by lora_alpha, rsLoRA, per-module
    rank and alpha) of rank <= `max_lora_rank` on LORA_MODULES."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type={peft_type!r} is not supported; only LoRA "
                         "adapters (peft_type='LORA') are served")
    for field in _VARIANTS:
        if config.get(field):
            raise ValueError(f"{where}: {field}={config[field]!r} is not supported; the engine "
                             f"serves plain LoRA adapters (retrain without {field})")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={config['bias']!r} is not supported (only 'none': "
                         "LoRA adapters that train no biases)")
    for field, kind in (("r", int), ("lora_alpha", (int, float))):
        value = config.get(field)
        if not isinstance(value, kind) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{where}: {field}={value!r} must be a positive number")
    ranks = {"r": config["r"], **{f"rank_pattern[{k!r}]": v
                                  for k, v in (config.get("rank_pattern") or {}).items()}}
    for field, rank in ranks.items():
        if rank > max_lora_rank:
            raise ValueError(f"{where}: LoRA rank {field}={rank} exceeds max_lora_rank="
                             f"{max_lora_rank}; serve with --max-lora-rank {rank} or more")
    targets = config.get("target_modules")
    if isinstance(targets, list):  # a string is a regex: the tensors found decide
        for target in targets:
            if str(target).rsplit(".", 1)[-1] not in LORA_MODULES:
                raise ValueError(f"{where}: target_modules entry {target!r} is not supported; "
                                 f"LoRA is served on {', '.join(LORA_MODULES)}")


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    """The tensors of `path/adapter_model.safetensors` by name."""
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        pickled = [f for f in ("adapter_model.bin", "adapter_model.pt")
                   if os.path.isfile(os.path.join(path, f))]
        if pickled:
            raise ValueError(f"{path}: {pickled[0]} (a pickle) is not read; save the adapter "
                             f"as {WEIGHTS_FILE} (peft's save_pretrained with "
                             "safe_serialization=True)")
        raise ValueError(f"{path}: no {WEIGHTS_FILE}")
    try:
        return load_file(file)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from None


def _lora_paths(cfg: ModelConfig) -> dict[str, tuple[tuple[str | int, ...], str]]:
    """Each module of LORA_MODULES the model has in its decoder layers -> (its kernel's
    module path, its checkpoint name with `{layer}`, without `.weight`)."""
    return {path[-2]: (path, name.removesuffix(".weight"))
            for path, name in family(cfg.architecture).hf_names(cfg).items()
            if len(path) == 4 and path[0] == "layers" and path[-1] == "kernel"
            and path[-2] in LORA_MODULES}


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of the base weight of each module of LORA_MODULES a model of `cfg` has in its
    decoder layers (at the checkpoint's sizes)."""
    shapes = model_weight_shapes(cfg)  # kernels are [Ly, in, out]
    return {module: shapes[path][1:] for module, (path, _) in _lora_paths(cfg).items()}


def _factors(tensors: Mapping[str, np.ndarray], cfg: ModelConfig, file: str
             ) -> dict[tuple[str, int], tuple[str, dict[str, np.ndarray]]]:
    """PEFT's tensors grouped by (module, layer) -> (PEFT's module name, {"A": , "B": })."""
    fam = family(cfg.architecture)
    slots = {name.format(layer=layer): (module, layer)
             for module, (path, name) in _lora_paths(cfg).items()
             for layer in range(cfg.num_layers) if not fam.layer_lacks(cfg, path, layer)}
    found: dict[tuple[str, int], tuple[str, dict[str, np.ndarray]]] = {}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", key)
        if match is None:
            raise ValueError(f"{file}: tensor {key!r} is not the A or B factor of a LoRA on a "
                             f"linear layer; LoRA is served on {', '.join(LORA_MODULES)} only")
        module_name, factor = match.groups()
        slot = slots.get(_text_name(module_name))
        if slot is None:
            raise ValueError(
                f"{file}: tensor {key!r} adapts {module_name!r}, which is not a module LoRA "
                f"is served on: {', '.join(LORA_MODULES)} of the decoder layers of this "
                f"{cfg.architecture} model ({cfg.num_layers} layers), not embeddings, the LM "
                "head or experts; remove it from target_modules, or, for an adapter of "
                "another base model, serve it with that model")
        found.setdefault(slot, (module_name, {}))[1][factor] = tensor
    for module_name, pair in found.values():
        if len(pair) != 2:
            lacking = ({"A", "B"} - pair.keys()).pop()
            raise ValueError(f"{file}: {module_name} has no lora_{lacking}.weight")
    return found


def _text_name(module_name: str) -> str:
    """A module name with a multimodal checkpoint's text-decoder prefix as `model.`."""
    for prefix in _TEXT_PREFIXES:
        if module_name.startswith(prefix):
            return "model." + module_name.removeprefix(prefix)
    return module_name


def _checked(pair: Mapping[str, np.ndarray], factor: str, shape: tuple[int, ...], module: str,
             file: str) -> np.ndarray:
    """Factor A or B of `pair` as float32, if it has the `shape` the base model implies."""
    tensor = pair[factor]
    if tensor.shape != shape:
        raise ValueError(f"{file}: {module}'s lora_{factor} has shape {tensor.shape}, but the "
                         f"base model with this rank implies {shape}; the adapter was trained "
                         "for another base model (or its r in adapter_config.json is wrong)")
    return tensor.astype(np.float32)


def _pattern(config: Mapping[str, Any], field: str, module_name: str, default: float) -> float:
    """A module's value in `rank_pattern` / `alpha_pattern` (PEFT's rule: the first key that
    matches the end of the module's name, as a regex), else `default`."""
    for key, value in (config.get(field) or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def _scale(alpha: float, r: int, rslora: bool) -> float:
    """LoRA's output scale: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
    return alpha / math.sqrt(r) if rslora else alpha / r
