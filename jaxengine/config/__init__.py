"""The engine's resolved configuration: `EngineConfig` and its parts, `SpeculativeConfig`,
`KVTransferConfig` and `LoRAConfig`.

A low layer: it imports nothing from jaxengine's other packages, only the `scheduler` package.
`jaxengine.engine.engine_config.create_engine_config` resolves `EngineArgs` into it; the
engine, the runner, KV offloading and the simulator read it.
"""

from jaxengine.config.engine import (
    DEFAULT_DTYPE,
    KV_CACHE_DTYPES,
    CacheConfig,
    Dtype,
    EngineConfig,
    KVCacheDtype,
    ParallelConfig,
    check_max_model_len,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from jaxengine.config.kv_transfer import KVTransferConfig
from jaxengine.config.lora import LORA_RANKS, LoRAConfig
from jaxengine.config.speculative import SpeculativeConfig

__all__ = ["DEFAULT_DTYPE", "KV_CACHE_DTYPES", "LORA_RANKS", "CacheConfig", "Dtype",
           "EngineConfig", "KVCacheDtype", "KVTransferConfig", "LoRAConfig", "ParallelConfig",
           "SpeculativeConfig",
           "check_max_model_len", "resolve_dtype", "resolve_kv_cache_dtype"]
