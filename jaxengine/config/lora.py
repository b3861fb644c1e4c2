"""`LoRAConfig`: the adapter limits of an engine that serves LoRA adapters (vLLM's `LoRAConfig`).

`jaxengine.engine.engine_config.create_engine_config` builds it from `EngineArgs(enable_lora=True,
...)`, with `max_cpu_loras` resolved (None: `max_loras`); without `enable_lora` there is none and
a request that carries an adapter is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's `LoRAConfig.max_lora_rank` choices: the ranks its kernels are tuned for.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoRAConfig:
    """How many adapters the device and the host hold, and how large they may be.

    Raises:
      ValueError: a limit below 1, a rank not in `LORA_RANKS`, or `max_cpu_loras` below
        `max_loras`; the message names the field.
    """

    max_loras: int  # adapters on the device at once = distinct adapters in one step
    max_lora_rank: int  # the device slots' rank r: an adapter of rank <= r is zero-padded
    max_cpu_loras: int  # adapters kept read on the host (LRU); more are read again from disk

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_cpu_loras"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {', '.join(map(str, LORA_RANKS))}, "
                             f"got {self.max_lora_rank!r}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= "
                             f"max_loras={self.max_loras} (every adapter on the device is also "
                             f"kept on the host)")
