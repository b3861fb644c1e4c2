"""`ModelFns`: the model's interface to everything that runs it (runner, `generate`, engine).

A real model (`jaxengine.engine.build.model_fns`) and the fake model (`jaxengine.model.fake`) are
both just these pure functions and their weights, so the loop above never knows which it has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from jaxengine.model.batch import ModelBatch
from jaxengine.model.lora import LoRALayout
from scheduler.kv.groups import FULL_ATTENTION, KVCacheGroup


# weakref_slot: the runner's jitted programs are dropped with the model (runner/programs.py).
@dataclass(frozen=True, slots=True, kw_only=True, weakref_slot=True)
class ModelFns:
    """What the runner needs from a model: pure functions and their weights."""

    params: Any  # pytree of weights (an nnx.State for the real model)
    step: Callable[[Any, jax.Array, ModelBatch], tuple[jax.Array, jax.Array]]  # -> kv, [T, D]
    compute_logits: Callable[[Any, jax.Array], jax.Array]  # hidden [R, D] -> f32[R, V]
    init_kv: Callable[[int, int], jax.Array]  # (num_blocks, block_size) -> zeroed cache
    # block_size -> a page's bytes on one device, in the layout of `init_group_kv`
    kv_bytes_per_block: Callable[[int], int]
    vocab_size: int
    # The model's KV cache groups (jaxengine/model/kv_groups.py): the scheduler's, and with
    # more than one the engine's pool is `init_group_kv`'s and its batches carry every
    # group's tables
    kv_cache_groups: tuple[KVCacheGroup, ...] = (FULL_ATTENTION,)
    # (num_blocks, block_size) -> a zeroed cache in the groups' layout; None: `init_kv`'s
    init_group_kv: Callable[[int, int], jax.Array] | None = None
    kv_page_axis: int = 1  # the cache's axis of pages (1 in [Ly, P, L, 2K, H]): KV offloading
    # copies whole pages along it (jaxengine/kv_offload)
    # The ids that end a generation unless the caller says otherwise (`jaxengine.generate`'s
    # default): the tokenizer's EOS ids; empty for a model without one (the fake model)
    eos_token_ids: tuple[int, ...] = ()
    # Where LoRA adapters go in this model (jaxengine/model/lora.py); its `step` then takes
    # the slots as a fourth argument. None: a model that serves no adapters (the fake one)
    lora_layout: LoRALayout | None = None
