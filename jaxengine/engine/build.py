"""Building an `LLMEngine` from `EngineArgs`: load the model, pick attention, resolve the
settings (`jaxengine.engine.engine_config`) with the model's and the devices' facts."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxengine.config import (
    Dtype,
    EngineConfig,
    KVCacheDtype,
    SpeculativeConfig,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from jaxengine.engine.args import EngineArgs
from jaxengine.engine.engine_config import create_engine_config
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.loading.load import load_model
from jaxengine.model.config import ModelConfig
from jaxengine.model.fns import ModelFns
from jaxengine.model.kv_cache import init_kv_cache, kv_cache_bytes_per_block
from jaxengine.model.kv_groups import kv_cache_layout
from jaxengine.model.lora import lora_layout
from jaxengine.model.mesh import engine_devices, make_mesh, mesh_platform
from jaxengine.model.packing import pack_projections, packable
from jaxengine.model.step import make_compute_logits, make_model_step, split_model
from jaxengine.model.tensor_parallel import tp_layout
from jaxengine.runner import compilation_cache
from jaxengine_kernels import UnsupportedShapeError, check_supported, cpu, default_impl
from jaxengine_kernels.cache_dtype import storage_dtype
from scheduler.kv.groups import max_concurrency

logger = logging.getLogger("jaxengine.engine")

# Leave room for activations when sizing the pool from device memory.
ACTIVATION_RESERVE = 0.1


def attention_backend(args: EngineArgs, cfg: ModelConfig) -> str:
    """`args.attention_backend`, else `jaxengine_kernels.default_impl()` (the platform's kernel).

    A kernel must run the model's shapes and hold its KV cache dtype on these devices: there is
    no silent fallback to the reference or to a float cache at trace time, so either is an
    error here, at engine build; so is an explicit "cpu" where the native kernel cannot be
    built.

    Raises:
      ValueError: the kernel cannot run the model's heads / head_dim / block_size (checked
        first: no platform would run them) or hold `kv_cache_dtype` on this device (fp8 on an
        older TPU or GPU), or it needs another platform, or the CPU kernel cannot be built
        here.
    """
    native = default_impl()  # the one mapping from platform to kernel
    chosen = args.attention_backend or native
    _check_kernel_shapes(chosen, cfg, block_size=args.block_size,
                         tp=args.tensor_parallel_size,
                         kv_cache_dtype=resolve_kv_cache_dtype(args.kv_cache_dtype,
                                                               resolve_dtype(args.dtype)))
    if chosen == "cpu" and jax.default_backend() == "cpu" and (why := cpu.available()):
        raise ValueError(f"attention_backend='cpu' needs the native CPU kernel, which cannot "
                         f"be built here ({why}); use attention_backend='reference'")
    if chosen not in ("reference", native):
        raise ValueError(
            f"attention_backend={chosen!r} needs a {chosen.upper()}, but jax's default backend "
            f"is {jax.default_backend()!r}; use attention_backend='reference' (or None to pick "
            f"by backend)"
        )
    return chosen


def _check_kernel_shapes(impl: str, cfg: ModelConfig, *, block_size: int, tp: int,
                         kv_cache_dtype: KVCacheDtype) -> None:
    """`ValueError` saying what to change if kernel `impl` cannot run this model with its
    cache in `kv_cache_dtype`.

    Under tensor parallelism the kernel runs per device, on that device's heads.
    """
    layout = tp_layout(cfg, tp)  # the heads' layout: expert parallelism does not change it
    num_heads, num_kv_heads = cfg.num_heads // tp, layout.kv_heads_per_device
    try:
        check_supported(impl, num_heads=num_heads, num_kv_heads=num_kv_heads,
                        head_dim=cfg.head_dim, page_size=block_size,
                        kv_cache_dtype=jnp.dtype(kv_cache_dtype))
    except UnsupportedShapeError as e:
        if e.field == "kv_cache_dtype":
            raise ValueError(f"attention_backend={impl!r} cannot hold a {kv_cache_dtype} KV "
                             f"cache on this device: {e}. Set kv_cache_dtype to one it holds "
                             f"('auto': the model's dtype).") from e
        shape = (f"num_heads={num_heads}, num_kv_heads={num_kv_heads}"
                 f"{' per device' if tp > 1 else ''}, head_dim={cfg.head_dim}, "
                 f"block_size={block_size}")
        # The kernel's page size is the engine's block_size; everything else is the model's.
        other = ("a block_size it accepts" if e.field == "page_size"
                 else "a model whose shapes it accepts")
        raise ValueError(
            f"attention_backend={impl!r} cannot run this model ({shape}): {e}. Set "
            f'attention_backend="reference" to run the jnp reference instead, or use {other}.'
        ) from e


def model_fns(model: Any, cfg: Any, *, attn_impl: str, pack: bool = True,
              batch_invariant: bool = False, kv_cache_dtype: KVCacheDtype | None = None,
              eos_token_ids: Sequence[int] = (), lora: bool = False) -> ModelFns:
    """`ModelFns` of a loaded `jaxengine.model.decoder.Model` (split once into graph and weights).

    The weights stay where the model put them (its mesh); the KV cache is made there too, in
    `kv_cache_dtype` (None: the model's dtype; fp8 on the CPU path as its bits in uint8,
    `jaxengine_kernels.cache_dtype.storage_dtype`), its head axis split over "tp", and
    `kv_bytes_per_block` counts one device's share of a page of the model's KV cache groups
    (`init_group_kv`, the engine's pool) in that dtype. With `pack`,
    the projections are first packed for the native CPU matmul in place where that applies
    (jaxengine/model/packing.py: a one-device CPU mesh in float32); else XLA's dots.

    With `batch_invariant` a request's logits do not depend on its batch: the packed matmul
    gives every row the same sums whatever the row count, and the attention kernel runs in
    its batch-invariant mode (the norms and the sampler's sums are invariant always).

    `eos_token_ids` (the tokenizer's; none without one) become `ModelFns.eos_token_ids`, where
    `jaxengine.generate` stops by default.

    With `lora` the model serves LoRA adapters (`ModelFns.lora_layout`, jaxengine/model/lora.py);
    a SwiGLU MLP is then packed without its fused gate/up call, which leaves no gate or up
    output for an adapter to add to.

    Raises:
      ValueError: `batch_invariant` where the projections cannot be packed (XLA's dots round a
        row differently as the row count changes) or the attention is not the "cpu" kernel.
    """
    if batch_invariant:
        _check_batch_invariant(packable(model) if pack else "pack=False", attn_impl)
    if pack:
        pack_projections(model, fuse_swiglu=not lora)
    graphdef, state = split_model(model)
    dtype, layout = jnp.dtype(kv_cache_dtype or model.dtype), model.layout
    stored = storage_dtype(dtype, impl=attn_impl, platform=mesh_platform(model.mesh))
    return ModelFns(
        params=state,
        step=make_model_step(graphdef, attn_impl=attn_impl, batch_invariant=batch_invariant,
                             kv_cache_dtype=dtype),
        compute_logits=make_compute_logits(graphdef),
        init_kv=lambda num_blocks, block_size: init_kv_cache(
            cfg, num_blocks=num_blocks, block_size=block_size, dtype=stored,
            num_kv_heads=layout.num_kv_heads, mesh=model.mesh),
        kv_bytes_per_block=lambda block_size: kv_cache_bytes_per_block(
            cfg, block_size=block_size, dtype=dtype, num_kv_heads=layout.num_kv_heads,
            shards=layout.tp, grouped=True),
        vocab_size=cfg.vocab_size,
        kv_cache_groups=kv_cache_layout(cfg).groups,
        init_group_kv=lambda num_blocks, block_size: init_kv_cache(
            cfg, num_blocks=num_blocks, block_size=block_size, dtype=stored,
            num_kv_heads=layout.num_kv_heads, mesh=model.mesh, grouped=True),
        eos_token_ids=tuple(int(i) for i in eos_token_ids),
        lora_layout=lora_layout(cfg, layout, mesh=model.mesh, dtype=model.dtype) if lora
        else None,
    )


def _check_batch_invariant(unpackable: str | None, attn_impl: str) -> None:
    """`ValueError` saying what to change if batch_invariant=True cannot hold."""
    if unpackable is not None:
        raise ValueError(
            f"batch_invariant=True needs the packed CPU matmul, which does not apply here "
            f"({unpackable}): XLA's dots sum a row in an order that depends on the row count. "
            f"Use one CPU device and dtype float32, or batch_invariant=False.")
    if attn_impl != "cpu":
        raise ValueError(
            f"batch_invariant=True needs attention_backend='cpu' (the native CPU kernel's "
            f"batch-invariant mode), got {attn_impl!r}; use the CPU kernel or "
            f"batch_invariant=False.")


def device_kv_budget_bytes(args: EngineArgs, device: jax.Device | None = None) -> int:
    """Bytes the devices give the KV pool: a fraction of `device`'s free memory on an
    accelerator, `cpu_kv_cache_bytes` on CPU (`kv_cache_memory_bytes`, when given, overrides
    this in `create_engine_config`).

    Args:
        device: whose free memory to measure (default: jax's first device).
    """
    device = device or jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return args.cpu_kv_cache_bytes
    free = stats["bytes_limit"] * args.gpu_memory_utilization - stats.get("bytes_in_use", 0)
    return int(free * (1 - ACTIVATION_RESERVE))


def resolve_config(args: EngineArgs, fns: ModelFns, cfg: ModelConfig,
                   device: jax.Device | None = None) -> EngineConfig:
    """`create_engine_config` for a loaded model (`fns`, of config `cfg`) on `device`'s
    memory (default: jax's first device).

    Raises:
      ValueError: what `create_engine_config` raises.
    """
    config = create_engine_config(
        args, model_max_model_len=cfg.max_model_len,
        kv_bytes_per_block=fns.kv_bytes_per_block(args.block_size),
        device_kv_budget_bytes=device_kv_budget_bytes(args, device),
        kv_cache_groups=fns.kv_cache_groups)
    s = config.scheduler
    logger.info("KV cache: %d blocks of %d tokens in %s, %d bytes each per device", s.num_blocks,
                s.block_size, config.cache.kv_cache_dtype, config.cache.kv_bytes_per_block)
    # vLLM's startup line: how many requests of max_model_len tokens the pool holds at once
    logger.info("Maximum concurrency for %d tokens per request: %.2fx", s.max_model_len,
                max_concurrency(s.kv_cache_groups, num_blocks=s.num_blocks,
                                block_size=s.block_size, num_tokens=s.max_model_len,
                                max_num_batched_tokens=(s.long_prefill_token_threshold
                                                        or s.max_num_scheduled_tokens)))
    return config


def load_draft(spec: SpeculativeConfig | None, *, dtype: Dtype, attention: str | None,
               kv_cache_dtype: KVCacheDtype | None = None) -> ModelFns | None:
    """The draft model's functions for `"method": "draft_model"` (None for other methods or
    no speculation), loaded as a target is: in `dtype` with its KV cache in `kv_cache_dtype`
    (the target's: vLLM's one cache config; None: `dtype`), with the `attention` backend (None: the
    platform's kernel), on jax's first device.

    Raises:
      ModelLoadError (a ValueError): a bad path or files, named by the loader.
    """
    if spec is None or spec.method != "draft_model":
        return None
    model, cfg, _ = load_model(spec.model, dtype=dtype, with_tokenizer=False)
    attn = attention_backend(EngineArgs(attention_backend=attention), cfg)
    return model_fns(model, cfg, attn_impl=attn, kv_cache_dtype=kv_cache_dtype)


def build_engine(args: EngineArgs, *, devices: Sequence[jax.Device] | None = None
                 ) -> LLMEngine:
    """Load `args.model` (never downloads) and build one engine replica around it: its
    settings resolved once (`resolve_config`), and the draft model's functions when
    speculative decoding asks for one.

    The model, the KV cache and the steps live on a mesh over the replica's devices (a
    1-device mesh for tensor_parallel_size=1: one code path). JAX's persistent compilation
    cache is pointed at `args.compilation_cache_dir` first, before anything compiles
    (`jaxengine.runner.compilation_cache`; process-global).

    Args:
      args: engine arguments.
      devices: the replica's `tensor_parallel_size` devices (global ones in multi-host);
        default: the first `tensor_parallel_size` of `jax.devices()`.
    Raises:
      ModelLoadError (a ValueError): bad model path or files.
      ValueError: settings that do not fit the model or the devices, or a KV pool too small
        for one request of max_model_len tokens.
    """
    compilation_cache.configure(args.compilation_cache_dir)
    mesh = make_mesh(engine_devices(args.tensor_parallel_size, devices))
    dtype = resolve_dtype(args.dtype)
    model, cfg, tokenizer = load_model(args.model, dtype=dtype,
                                       with_tokenizer=not args.skip_tokenizer_init, mesh=mesh,
                                       expert_parallel=args.enable_expert_parallel,
                                       quantization=args.quantization)
    # The pool's pages are sized in the cache's dtype before the config is resolved.
    fns = model_fns(model, cfg, attn_impl=attention_backend(args, cfg),
                    batch_invariant=args.batch_invariant,
                    kv_cache_dtype=resolve_kv_cache_dtype(args.kv_cache_dtype, dtype),
                    eos_token_ids=() if tokenizer is None else tokenizer.eos_token_ids,
                    lora=args.enable_lora)
    config = resolve_config(args, fns, cfg, mesh.devices.flat[0])
    draft = load_draft(config.speculative, dtype=config.dtype,
                       kv_cache_dtype=config.cache.kv_cache_dtype,
                       attention=args.attention_backend)
    return LLMEngine(fns, args, config, tokenizer=tokenizer, draft=draft)

