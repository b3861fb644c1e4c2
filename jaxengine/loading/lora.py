"""Reading a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) into
`LoRAAdapter`: per target module the stacked A [Ly, r, in] and B [Ly, out, r] in float32, with
the scaling PEFT applies (`lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`).

The device side (jaxengine/model/lora.py) puts these into its slots; this module only reads and
checks them against the base model's shapes.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from jaxengine.model.config import ModelConfig

# The projections an adapter may target, as HF (and PEFT's target_modules) name them.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_MODULES = LORA_MODULES[:4]
_TENSOR = re.compile(r".*\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter, read and checked against its base model."""

    name: str
    rank: int  # r
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    # module -> (A [Ly, r, in], B [Ly, out, r]) float32, module in LORA_MODULES; a module the
    # adapter does not target is absent, a layer it does not target holds zeros
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection an adapter may target, at the checkpoint's sizes."""
    D, F, H = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * H, cfg.num_kv_heads * H
    return {"q_proj": (D, q), "k_proj": (D, kv), "v_proj": (D, kv), "o_proj": (q, D),
            "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D)}


def load_peft_adapter(path: str | Path, model_config: ModelConfig, *, max_lora_rank: int
                      ) -> LoRAAdapter:
    """Read the PEFT adapter in directory `path` for a base model of `model_config`.

    Raises:
      ValueError: no adapter there, a rank above `max_lora_rank`, a target module or variant
        (DoRA, bias) not served, or a tensor whose shape is not the base model's; the message
        names the field and what to change.
    """
    root = Path(path)
    config_file, weights_file = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(f"lora_path={str(path)!r} must be a PEFT adapter directory holding "
                         f"adapter_config.json and adapter_model.safetensors")
    config = json.loads(config_file.read_text())
    rank, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    _check_config(config, rank, max_lora_rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = _stack(load_file(str(weights_file)), model_config, rank)
    return LoRAAdapter(name=root.name, rank=rank, scaling=scaling, weights=weights)


def _check_config(config: dict, rank: int, max_lora_rank: int) -> None:
    if rank < 1 or rank > max_lora_rank:
        raise ValueError(f"adapter_config.json r={rank} is above max_lora_rank="
                         f"{max_lora_rank}: raise max_lora_rank to at least {rank}")
    if config.get("use_dora"):
        raise ValueError("adapter_config.json use_dora=true: DoRA adapters are not served")
    if config.get("bias", "none") != "none":
        raise ValueError(f"adapter_config.json bias={config['bias']!r}: only 'none' is served")


def _stack(tensors: dict[str, np.ndarray], cfg: ModelConfig, rank: int
           ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The PEFT tensors stacked per module into (A [Ly, r, in], B [Ly, out, r])."""
    shapes = module_shapes(cfg)
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for key, value in tensors.items():
        match = _TENSOR.match(key)
        module = match.group(2) if match else None
        if match is None or module not in shapes:
            raise ValueError(f"adapter tensor {key!r}: only the modules "
                             f"{', '.join(LORA_MODULES)} of the decoder layers are served")
        layer, which = int(match.group(1)), match.group(3)
        fan_in, fan_out = shapes[module]
        want = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(value.shape) != want or layer >= cfg.num_layers:
            raise ValueError(f"adapter tensor {key!r} has shape {tuple(value.shape)}, the base "
                             f"model needs {want} (an adapter of another base model?)")
        if module not in out:
            out[module] = (np.zeros((cfg.num_layers, rank, fan_in), np.float32),
                           np.zeros((cfg.num_layers, fan_out, rank), np.float32))
        out[module][0 if which == "A" else 1][layer] = value.astype(np.float32)
    return out
