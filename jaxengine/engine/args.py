"""`EngineArgs`: every engine setting, with vLLM's names, frozen and validated."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, get_args

import scheduler
from jaxengine.config import (
    KV_CACHE_DTYPES,
    LORA_RANKS,
    Dtype,
    KVTransferConfig,
    LoRAConfig,
    SpeculativeConfig,
)
from jaxengine.model.quant import QUANTIZATIONS

DTYPES = ("auto", *get_args(Dtype))  # "auto": jaxengine.config.DEFAULT_DTYPE
ATTENTION_BACKENDS = ("reference", "cpu", "tpu", "gpu")


def arg(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with its default and the help text the CLI shows for its flag
    (`jaxengine/flags.py` reads it); `kw` go to `dataclasses.field`."""
    return dataclasses.field(default=default, metadata={"help": help}, **kw)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EngineArgs:
    """Engine settings as the user gives them (vLLM's engine-argument names), each field
    checked when built; None and "auto" are resolved at startup, once, by
    `jaxengine.engine.engine_config.create_engine_config`."""

    model: str | None = arg(None, "HF directory or .gguf file; None: the embedded "
                                  "SmolLM2-135M-Instruct")
    dtype: str = arg("auto", "weights and activations (and the KV cache, see kv_cache_dtype): "
                             "auto (= float32), float32 or bfloat16")
    quantization: str | None = arg(
        None, "weights on the device: None (the checkpoint's floats in dtype), int8 or fp8 "
              "(weight-only: int8 a scale per 32 inputs, fp8 one per output channel; "
              "quantized at load from the float weights; a GGUF's blocks are dequantized "
              "first), or gguf (a .gguf "
              "file's quantized tensors served from their blocks)")
    kv_cache_dtype: str = arg(
        "auto", "the KV cache's dtype: auto (the model's dtype), bfloat16, fp8 (= fp8_e4m3) or "
                "fp8_e5m2; fp8 stores k / k_scale and v / v_scale (the checkpoint's per-layer "
                "scales, else 1.0), saturated to the format's range")
    seed: int = arg(0, "seeds the per-request seeds of requests that give none")
    max_model_len: int | None = arg(None, "longest sequence (prompt + output); None: the "
                                          "model's max positions")
    max_num_batched_tokens: int | None = arg(
        None, "tokens one step may process; None: 2048 (max_model_len if not chunking)")
    max_num_scheduled_tokens: int | None = arg(
        None, "tokens the scheduler hands out per step, drafts being verified included (at "
              "most max_num_batched_tokens, which sizes the runner); None: "
              "max_num_batched_tokens")
    max_num_seqs: int = arg(128, "most requests running at once")
    enable_chunked_prefill: bool = arg(True, "split long prompts over several steps")
    enable_prefix_caching: bool = arg(True, "reuse the KV of shared prompt prefixes")
    block_size: int = arg(16, "tokens per KV cache page")
    num_gpu_blocks_override: int | None = arg(
        None, "KV pages in the pool, the null block 0 included; None: from the memory budget")
    kv_cache_memory_bytes: int | None = arg(
        None, "KV cache budget in bytes; None: see gpu_memory_utilization / cpu_kv_cache_bytes")
    gpu_memory_utilization: float = arg(
        0.9, "accelerators: fraction of device memory for the run (weights, KV, activations)")
    cpu_kv_cache_bytes: int = arg(1 << 30, "CPU: the KV budget when none is given")
    kv_offloading_size: float | None = arg(
        None, "GiB of host memory for KV blocks evicted from the device's prefix cache, loaded "
              "back when a prefix needs them again; None or 0: off (needs prefix caching)")
    kv_transfer_config: dict[str, Any] | None = arg(
        None, "prefill/decode disaggregation, vLLM's dict (JSON on the command line), e.g. "
              '{"kv_role": "kv_producer", "kv_port": 14579} (a prefill instance: keeps its '
              'prompts\' KV for pickup) or {"kv_role": "kv_consumer"} (a decode instance: '
              "loads it); kv_connector: only JaxEngineConnector (the default); None: off")
    long_prefill_token_threshold: int = arg(
        0, "most tokens one request gets in one step while others wait (0: no cap)")
    max_num_partial_prefills: int = arg(1, "prompts partially prefilled at once (>1: "
                                           "concurrent partial prefill limits)")
    max_long_partial_prefills: int = arg(1, "of those, most long ones at once")
    scheduling_policy: str = arg("fcfs", "order of waiting requests and preemption victims: a "
                                         "registered policy (on the command line also "
                                         "MODULE:CLASS, imported and registered)")
    attention_backend: str | None = arg(None, "attention implementation; None: chosen by "
                                              "jax.default_backend()")
    batch_invariant: bool = arg(
        False, "a request's logits and logprobs the same bits whatever else runs beside it "
               "and however its prompt is chunked (vLLM's VLLM_BATCH_INVARIANT): the CPU "
               "attention kernel's batch-invariant mode beside the packed matmul; needs "
               "float32 on one CPU device; decode-heavy steps cost 1.1-1.25x")
    precompile: bool | None = arg(
        None, "compile every token/request bucket at startup; None: LLM() does, with a progress "
              "bar, a bare LLMEngine does not (serve always warms up before /health is 200)")
    async_scheduling: bool = arg(True, "schedule step N+1 on the host while the device runs "
                                       "step N (same outputs as the synchronous loop; with "
                                       "speculative_config a request verifying drafts sits "
                                       "out the next step)")
    speculative_config: dict[str, Any] | None = arg(
        None, "speculative decoding, vLLM's dict (JSON on the command line), e.g. "
              '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, '
              '"prompt_lookup_max": 4} or {"method": "draft_model", "model": DIR, '
              '"num_speculative_tokens": 3}; None: off')
    enable_lora: bool = arg(False, "serve LoRA adapters (PEFT directories): a request names one "
                                   "with lora_request")
    max_loras: int = arg(1, "with enable_lora: adapters on the device at once, the most "
                            "distinct adapters one step serves (more wait their turn)")
    max_lora_rank: int = arg(16, "with enable_lora: the highest adapter rank served (one of "
                                 f"{', '.join(map(str, LORA_RANKS))}); the device slots are "
                                 "this wide")
    max_cpu_loras: int | None = arg(None, "with enable_lora: adapters kept read in host memory "
                                          "(LRU), at least max_loras; None: max_loras")
    compilation_cache_dir: str | None = arg(
        None, "directory of JAX's persistent compilation cache (process-wide); None: "
              "$JAXENGINE_COMPILATION_CACHE_DIR, else JAX's own setting, else "
              "$XDG_CACHE_HOME/jaxengine/jax (~/.cache/jaxengine/jax); '' disables")
    debug_recompiles: bool = arg(False, "raise if anything compiles after warm-up")
    max_logprobs: int = arg(20, "most top logprobs a request may ask for")
    intermediate_token_buckets: bool = arg(False, "1.5x token buckets too: less padding, "
                                                  "more compilations")
    skip_tokenizer_init: bool = arg(False, "load no tokenizer: prompts are token ids and "
                                           "outputs have no text")
    generation_config: str = arg("auto", "default sampling parameters: auto (the model's "
                                         "generation_config.json), vllm (none) or a directory")
    tensor_parallel_size: int = arg(1, "devices one engine replica's model is split over "
                                       "(tensor parallel, mesh axis tp)")
    data_parallel_size: int = arg(1, "engine replicas, each on its own tensor_parallel_size "
                                     "devices, behind a prefix-aware router")
    enable_expert_parallel: bool = arg(False, "mixture-of-experts models: split the experts "
                                              "whole over the tensor-parallel devices (each "
                                              "holds E/tp experts) instead of each expert's "
                                              "width; attention stays tensor parallel")
    coordinator_address: str | None = arg(
        None, "multi-host: HOST:PORT of process 0's jax.distributed coordinator (the same on "
              "every process); None with the next two: detected by JAX (Cloud TPU, SLURM, ...) "
              "or a single process")
    num_processes: int | None = arg(None, "multi-host: how many processes (hosts) take part")
    process_id: int | None = arg(None, "multi-host: this process's index, 0 .. num_processes-1 "
                                       "(0 serves HTTP, the others run serve --headless)")

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, DTYPES)
        if self.quantization is not None:
            _check_choice("quantization", self.quantization, QUANTIZATIONS)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, tuple(KV_CACHE_DTYPES))
        # Any policy registered with the scheduler, research ones included.
        _check_choice("scheduling_policy", self.scheduling_policy, tuple(scheduler.POLICIES))
        if self.attention_backend is not None:
            _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        for name in ("max_num_seqs", "block_size", "tensor_parallel_size", "data_parallel_size"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_scheduled_tokens",
                     "kv_cache_memory_bytes"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        if self.num_gpu_blocks_override is not None:
            _check_int("num_gpu_blocks_override", self.num_gpu_blocks_override, minimum=2)
        _check_kv_offloading(self)
        _check_kv_transfer(self)
        _check_batch_invariant(self)
        for name in ("long_prefill_token_threshold", "max_logprobs", "seed"):
            _check_int(name, getattr(self, name), minimum=0)
        for name in ("max_num_partial_prefills", "max_long_partial_prefills"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_distributed(self)
        _check_lora(self)
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)  # raises naming the key
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Build from keyword arguments; an unknown name raises `ValueError` naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            hints = []
            for name in unknown:
                close = difflib.get_close_matches(name, known, n=1)
                hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(f"unknown engine argument(s): {', '.join(hints)}")
        return cls(**kwargs)


def _check_distributed(args: EngineArgs) -> None:
    """coordinator_address is HOST:PORT; 0 <= process_id < num_processes where both are given."""
    if args.num_processes is not None:
        _check_int("num_processes", args.num_processes, minimum=1)
    if args.process_id is not None:
        _check_int("process_id", args.process_id, minimum=0)
        if args.num_processes is not None and args.process_id >= args.num_processes:
            raise ValueError(f"process_id must be below num_processes={args.num_processes}, "
                             f"got {args.process_id}")
    address = args.coordinator_address
    if address is not None:
        host, _, port = str(address).rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"coordinator_address must be HOST:PORT (process 0's address), "
                             f"got {address!r}")


def _check_lora(args: EngineArgs) -> None:
    """enable_lora is a bool; the adapter limits hold together as `LoRAConfig` checks them
    (vLLM's rules), whether or not LoRA is on, so a bad value is never silently kept."""
    if not isinstance(args.enable_lora, bool):
        raise ValueError(f"enable_lora must be True or False, got {args.enable_lora!r}")
    if args.max_cpu_loras is not None:
        _check_int("max_cpu_loras", args.max_cpu_loras, minimum=1)
    _check_int("max_loras", args.max_loras, minimum=1)
    LoRAConfig(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
               max_cpu_loras=args.max_cpu_loras or args.max_loras)


def _check_batch_invariant(args: EngineArgs) -> None:
    """batch_invariant is a bool, and with it the settings that rule it out are not given (what
    only the loaded model tells, jaxengine.engine.build checks)."""
    if not isinstance(args.batch_invariant, bool):
        raise ValueError(f"batch_invariant must be True or False, got {args.batch_invariant!r}")
    if not args.batch_invariant:
        return
    # The packed matmul and the CPU kernel's batch-invariant mode are what make it hold.
    if args.dtype == "bfloat16":
        raise ValueError("batch_invariant=True needs dtype float32 (or auto): bfloat16 "
                         "projections are XLA's dots, whose row sums depend on the row count")
    if args.quantization is not None:
        raise ValueError(f"batch_invariant=True needs float weights (the packed CPU matmul is "
                         f"float32), got quantization={args.quantization!r}")
    if args.tensor_parallel_size != 1:
        raise ValueError(f"batch_invariant=True needs tensor_parallel_size=1 (the packed CPU "
                         f"matmul), got {args.tensor_parallel_size}")
    if args.enable_lora:
        raise ValueError("batch_invariant=True does not serve LoRA adapters (enable_lora): "
                         "their updates are XLA's dots, whose row sums depend on the row count")
    if args.attention_backend not in (None, "cpu"):
        raise ValueError(f"batch_invariant=True needs attention_backend 'cpu' (or None on a "
                         f"CPU), got {args.attention_backend!r}: only the native CPU kernel has "
                         f"a batch-invariant mode")


def _check_kv_offloading(args: EngineArgs) -> None:
    """kv_offloading_size is a number of GiB >= 0 and needs the prefix cache's block hashes."""
    size = args.kv_offloading_size
    if size is None:
        return
    number = isinstance(size, int | float) and not isinstance(size, bool)
    if not number or not 0 <= size < float("inf"):
        raise ValueError(f"kv_offloading_size must be a finite number of GiB >= 0 (None or "
                         f"0: off), got {size!r}")
    if size and not args.enable_prefix_caching:
        raise ValueError("kv_offloading_size needs enable_prefix_caching=True: host blocks are "
                         "found by their prefix-cache hashes; enable it, or unset "
                         "kv_offloading_size")


def _check_kv_transfer(args: EngineArgs) -> None:
    """kv_transfer_config parses (`KVTransferConfig.from_dict`), and the settings it cannot
    serve with are not given: each engine's transfer server is one port and moves one pool."""
    if args.kv_transfer_config is None:
        return
    KVTransferConfig.from_dict(args.kv_transfer_config)  # raises naming the key
    if args.kv_offloading_size:
        raise ValueError(f"kv_transfer_config cannot be combined with kv_offloading_size="
                         f"{args.kv_offloading_size} (one KV connector per engine); unset one")
    if args.data_parallel_size != 1:
        raise ValueError(f"kv_transfer_config needs data_parallel_size=1 (got "
                         f"{args.data_parallel_size}): run one instance per replica behind "
                         f"`jaxengine proxy` instead")
    if args.num_processes not in (None, 1):
        raise ValueError(f"kv_transfer_config is not supported with num_processes="
                         f"{args.num_processes} (a multi-host engine) yet")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
