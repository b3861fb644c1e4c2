"""`EngineConfig`: one engine's settings, resolved once and frozen (vLLM's `VllmConfig`).

`jaxengine.engine.engine_config.create_engine_config` builds it from `EngineArgs`, the model's
limits and what the devices hold: that function is the only place a default is decided (dtype
"auto", the token budget, max_model_len, the KV pool's size, the offloading store's bytes).
The engine and what it drives (runner, speculative decoding, KV offloading), and the simulator,
read this object, never the arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from jaxengine.config.kv_transfer import KVTransferConfig
from jaxengine.config.lora import LoRAConfig
from jaxengine.config.speculative import SpeculativeConfig
from scheduler import SchedulerConfig

Dtype = Literal["float32", "bfloat16"]  # of the weights and activations
DEFAULT_DTYPE: Dtype = "float32"  # what dtype "auto" means
# The KV cache's dtype as jnp names it; "auto" is the model's `Dtype`.
KVCacheDtype = Literal["float32", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
# vLLM's `kv_cache_dtype` values -> the cache's dtype ("auto": the model's)
KV_CACHE_DTYPES: dict[str, KVCacheDtype | None] = {
    "auto": None, "bfloat16": "bfloat16", "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def resolve_dtype(dtype: str) -> Dtype:
    """The dtype an argument names: "auto" is `DEFAULT_DTYPE`, any other is itself.

    Raises:
      ValueError: not "auto", "float32" or "bfloat16".
    """
    resolved = DEFAULT_DTYPE if dtype == "auto" else dtype
    if resolved not in get_args(Dtype):
        raise ValueError(f"dtype must be one of auto, {', '.join(get_args(Dtype))}; "
                         f"got {dtype!r}")
    return resolved  # type: ignore[return-value]  # checked against Dtype just above


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: Dtype) -> KVCacheDtype:
    """The KV cache's dtype for a `kv_cache_dtype` argument (vLLM's values) and the model's
    resolved `dtype`: "auto" is the model's, "fp8" is "fp8_e4m3" (float8_e4m3fn).

    Raises:
      ValueError: not one of `KV_CACHE_DTYPES`; the message lists them.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (auto: "
                         f"the model's dtype); got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or dtype


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheConfig:
    """What sized the KV pool, and the host store behind it (the pool's own shape,
    `block_size` and `num_blocks`, is the scheduler's)."""

    kv_cache_dtype: KVCacheDtype  # the pool's dtype (fp8: k / k_scale stored, saturated)
    kv_bytes_per_block: int  # one page across all layers on one device, in kv_cache_dtype
    kv_budget_bytes: int  # what the devices give the pool (num_gpu_blocks_override aside)
    kv_offloading_bytes: int | None  # host store for prefix blocks evicted; None: off


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    """How one engine replica is laid over devices, and how many replicas serve."""

    tensor_parallel_size: int  # devices the model of one replica is split over ("tp")
    data_parallel_size: int  # replicas behind the router


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """An engine's resolved settings: the scheduler's, the runner's, the KV cache's, the
    parallel layout and speculative decoding. Frozen.

    Each value is checked once: a field as the user gave it by `EngineArgs`, the batch limits
    and the pool's shape by `SchedulerConfig`, the speculative settings by
    `SpeculativeConfig`; what only the resolution knows (the dtype, the model's limit) here.

    Raises:
      ValueError: a dtype other than float32 / bfloat16, or a max_model_len beyond the model's.
    """

    dtype: Dtype  # weights and activations; the KV cache's is `cache.kv_cache_dtype`
    model_max_model_len: int  # the model's own limit; scheduler.max_model_len <= it
    scheduler: SchedulerConfig  # batch limits, max_model_len, the KV pool's shape
    cache: CacheConfig
    parallel: ParallelConfig
    speculative: SpeculativeConfig | None  # None: no speculative decoding
    lora: LoRAConfig | None  # None: LoRA off, a request with an adapter is refused
    max_logprobs: int  # most top logprobs a request may ask for
    intermediate_token_buckets: bool  # 1.5x token buckets too
    debug_recompiles: bool  # raise on a compilation after warm-up
    precompile: bool | None  # compile every bucket at startup; None: the caller's choice
    seed: int  # seeds the per-request seeds of requests that give none
    kv_transfer: KVTransferConfig | None = None  # prefill/decode disaggregation; None: off

    def __post_init__(self) -> None:
        if self.dtype not in get_args(Dtype):
            raise ValueError(f"dtype must be one of {', '.join(get_args(Dtype))} (resolved), "
                             f"got {self.dtype!r}")
        check_max_model_len(self.scheduler.max_model_len, self.model_max_model_len)

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) a request may reach."""
        return self.scheduler.max_model_len

    @property
    def num_speculative_tokens(self) -> int:
        """K, the most draft tokens a request verifies per step (0: no speculation)."""
        return 0 if self.speculative is None else self.speculative.num_speculative_tokens


def check_max_model_len(max_model_len: int, limit: int) -> None:
    """`ValueError` if `max_model_len` exceeds the model's `limit` (its positions, capped by a
    sliding window)."""
    if max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's limit of {limit}")
