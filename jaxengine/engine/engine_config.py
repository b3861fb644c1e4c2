"""`create_engine_config`: `EngineArgs` resolved into one frozen `EngineConfig`.

The only place a default is decided: dtype "auto", kv_cache_dtype "auto", the token budgets
(the runner's and the scheduler's), max_model_len (the model's limit), the KV pool's size
(`num_gpu_blocks_override`, else the budget), the offloading store's bytes, the
debug-recompiles switch. The engine's build calls
it with the loaded model's facts and the devices' free memory; the simulator with the
calibrated machine's.
"""

from __future__ import annotations

from jaxengine.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    LoRAConfig,
    ParallelConfig,
    SpeculativeConfig,
    check_max_model_len,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from jaxengine.engine.args import EngineArgs
from jaxengine.runner.compiles import debug_recompiles_from_env
from scheduler import SchedulerConfig
from scheduler.kv.groups import FULL_ATTENTION, KVCacheGroup, max_group_blocks, one_full_group

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's token budget per step under chunked prefill


def create_engine_config(args: EngineArgs, *, model_max_model_len: int,
                         kv_bytes_per_block: int, device_kv_budget_bytes: int,
                         kv_cache_groups: tuple[KVCacheGroup, ...] = (FULL_ATTENTION,)
                         ) -> EngineConfig:
    """Resolve `args` for one model on one replica's devices.

    Args:
      args: the engine arguments (validated field by field when built).
      model_max_model_len: the model's own limit (`ModelConfig.max_model_len`).
      kv_bytes_per_block: bytes one KV page of `args.block_size` tokens takes on one device,
        in the resolved KV cache dtype (`resolve_kv_cache_dtype`).
      device_kv_budget_bytes: what the devices give the KV pool when `kv_cache_memory_bytes`
        is unset (`jaxengine.engine.build.device_kv_budget_bytes`).
      kv_cache_groups: the model's KV cache groups (`ModelFns.kv_cache_groups`), for the
        scheduler and the pool's size; `kv_bytes_per_block` is a page of their layout.
    Returns:
      The frozen `EngineConfig` every layer below the engine reads.
    Raises:
      ValueError: max_model_len beyond the model's limit, a pool that cannot hold one request
        of max_model_len tokens, scheduler limits that do not fit together (the token
        budgets with speculative decoding: `max_num_scheduled_tokens`), or a setting the
        model's KV cache groups cannot serve (`check_kv_cache_groups`); the message names the
        setting to change.
    """
    max_model_len = args.max_model_len or model_max_model_len
    check_max_model_len(max_model_len, model_max_model_len)
    check_kv_cache_groups(args, kv_cache_groups)
    budget = (args.kv_cache_memory_bytes if args.kv_cache_memory_bytes is not None
              else device_kv_budget_bytes)
    batched = max_num_batched_tokens(args, max_model_len)
    speculative = (None if args.speculative_config is None
                   else SpeculativeConfig.from_dict(args.speculative_config))
    scheduled = max_num_scheduled_tokens(args, batched, speculative)
    num_blocks = num_kv_blocks(args, max_model_len=max_model_len,
                               kv_bytes_per_block=kv_bytes_per_block, budget=budget,
                               groups=kv_cache_groups,
                               step_tokens=args.long_prefill_token_threshold or scheduled)
    scheduler = SchedulerConfig(
        kv_cache_groups=kv_cache_groups,
        max_num_batched_tokens=batched, max_num_scheduled_tokens=scheduled,
        max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        max_long_partial_prefills=args.max_long_partial_prefills,
        policy=args.scheduling_policy, block_size=args.block_size, num_blocks=num_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        async_scheduling=args.async_scheduling,
        max_loras=args.max_loras if args.enable_lora else None)
    dtype = resolve_dtype(args.dtype)
    return EngineConfig(
        dtype=dtype, model_max_model_len=model_max_model_len,
        scheduler=scheduler,
        cache=CacheConfig(kv_cache_dtype=resolve_kv_cache_dtype(args.kv_cache_dtype, dtype),
                          kv_bytes_per_block=kv_bytes_per_block, kv_budget_bytes=budget,
                          kv_offloading_bytes=(int(args.kv_offloading_size * 2**30)
                                               if args.kv_offloading_size else None)),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                data_parallel_size=args.data_parallel_size),
        speculative=speculative,
        lora=LoRAConfig(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                        max_cpu_loras=args.max_cpu_loras or args.max_loras)
        if args.enable_lora else None,
        max_logprobs=args.max_logprobs,
        intermediate_token_buckets=args.intermediate_token_buckets,
        debug_recompiles=args.debug_recompiles or debug_recompiles_from_env(),
        precompile=args.precompile, seed=args.seed,
        kv_transfer=(None if args.kv_transfer_config is None
                     else KVTransferConfig.from_dict(args.kv_transfer_config)))


def max_num_batched_tokens(args: EngineArgs, max_model_len: int) -> int:
    """The token budget: as given, else 2048 (at least max_num_seqs), or max_model_len when
    prefill is unchunked (a whole prompt must fit one step)."""
    if args.max_num_batched_tokens is not None:
        return args.max_num_batched_tokens
    if not args.enable_chunked_prefill:
        return max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)
    return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, args.max_num_seqs)


def max_num_scheduled_tokens(args: EngineArgs, batched: int,
                             speculative: SpeculativeConfig | None) -> int:
    """The scheduler's per-step budget: as given, else the runner's `batched`, with speculative
    decoding too, as vLLM 0.33's `_set_max_num_scheduled_tokens` (no drafter here adds tokens
    to a step). Whether it fits `batched` is `SchedulerConfig`'s check (docs/SCHEDULING.md §2,
    "Two token budgets").

    Raises:
      ValueError: with speculative decoding, `batched` leaves no room for a token beside the
        drafter's lookahead slots (vLLM's refusal, so a configuration it refuses is refused
        here too); the message says what to change.
    """
    if speculative is not None and batched <= speculative.num_lookahead_tokens:
        k = speculative.num_lookahead_tokens
        raise ValueError(
            f"max_num_batched_tokens={batched} leaves no room for a token beside the "
            f"{k} lookahead slots of speculative_config method {speculative.method!r} "
            f"(num_speculative_tokens={speculative.num_speculative_tokens}). Raise "
            f"max_num_batched_tokens above {k} or lower num_speculative_tokens.")
    return batched if args.max_num_scheduled_tokens is None else args.max_num_scheduled_tokens


def check_kv_cache_groups(args: EngineArgs, groups: tuple[KVCacheGroup, ...]) -> None:
    """`ValueError` naming the setting if the model's KV cache groups cannot serve `args`
    (docs/SCHEDULING.md §13, "Refused for now"): KV offloading and KV transfer need a single
    full-attention group (their loads and saves are block lists of one table), and a draft
    model reads the target's first group's tables, so that group must keep every block."""
    if one_full_group(groups):
        return
    if args.kv_offloading_size:
        raise ValueError(
            f"kv_offloading_size={args.kv_offloading_size} is not supported for a model with "
            f"sliding-window or several KV cache groups ({_describe(groups)}): offloading "
            f"moves the blocks of one full-attention table. Leave kv_offloading_size unset.")
    if args.kv_transfer_config is not None:
        raise ValueError(
            f"kv_transfer_config is not supported for a model with sliding-window or several "
            f"KV cache groups ({_describe(groups)}): a transfer moves the blocks of one "
            f"full-attention table. Leave kv_transfer_config unset.")
    spec = args.speculative_config or {}
    if spec.get("method") == "draft_model" and groups[0].sliding_window is not None:
        raise ValueError(
            f"speculative_config method 'draft_model' needs a target with a full-attention "
            f"layer (its draft shares the target's first KV cache group's blocks), but every "
            f"layer slides ({_describe(groups)}); use another method.")


def _describe(groups: tuple[KVCacheGroup, ...]) -> str:
    """"1 full, 5 sliding (window 512) groups of 1 layer"."""
    full = sum(g.sliding_window is None for g in groups)
    windows = sorted({g.sliding_window for g in groups if g.sliding_window is not None})
    return (f"{full} full, {len(groups) - full} sliding (window "
            f"{', '.join(map(str, windows))}) groups of {groups[0].num_layers} layers")


def num_kv_blocks(args: EngineArgs, *, max_model_len: int, kv_bytes_per_block: int,
                  budget: int, groups: tuple[KVCacheGroup, ...] = (FULL_ATTENTION,),
                  step_tokens: int = 1) -> int:
    """Pages in the pool, the null block 0 included: `num_gpu_blocks_override`, else what
    `budget` bytes hold.

    Args:
      groups: the model's KV cache groups: one request holds, summed over them, at most
        `max_group_blocks` (all of its blocks for full attention, a window's for a sliding
        group).
      step_tokens: the most tokens a request computes in one step (a sliding group holds
        a window plus one step's tokens).
    Raises:
      ValueError: the pool cannot hold one request of `max_model_len` tokens. vLLM refuses to
        start then too; the message gives the numbers and what to change.
    """
    bs, per_block = args.block_size, kv_bytes_per_block

    def blocks_for(num_tokens: int) -> int:  # one request of num_tokens, plus the null block
        return sum(max_group_blocks(g, num_tokens, bs, step_tokens) for g in groups) + 1

    def longest(blocks: int) -> int:  # the longest max_model_len `blocks` hold
        return max(n for n in range(0, (blocks - 1) * bs + 1, bs) if blocks_for(n) <= blocks)

    need = blocks_for(max_model_len)
    if args.num_gpu_blocks_override is not None:
        blocks = args.num_gpu_blocks_override
        if blocks < need:
            raise ValueError(
                f"num_gpu_blocks_override={blocks} leaves {blocks - 1} usable KV blocks of {bs} "
                f"tokens, but one request of max_model_len={max_model_len} tokens needs "
                f"{need - 1} (plus the null block: {need} in all). Raise "
                f"num_gpu_blocks_override to at least {need}, or lower max_model_len to at most "
                f"{longest(blocks)}.")
        return blocks
    blocks = max(budget // per_block, 0)  # a device already full gives a negative budget
    if blocks < need:
        shrink = (f"lower max_model_len to at most {longest(blocks)}, or "
                  if blocks >= 2 else "")
        raise ValueError(
            f"the KV cache budget of {budget} bytes ({_size(budget)}) holds {blocks} blocks of "
            f"{bs} tokens ({per_block} bytes each, null block included), but one request of "
            f"max_model_len={max_model_len} tokens needs {need} blocks: {need * per_block} "
            f"bytes ({_size(need * per_block)}). To start, {shrink}raise the budget "
            f"(kv_cache_memory_bytes; or gpu_memory_utilization on an accelerator, "
            f"cpu_kv_cache_bytes on CPU), or set num_gpu_blocks_override >= {need}.")
    return int(blocks)


def _size(n: int) -> str:
    """`n` bytes for a reader: "1.50 GiB", "96.0 KiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"
