"""`ModelFns`: the model's interface to everything that runs it (runner, `generate`, engine).

A real model (`jaxengine.engine.build.model_fns`) and the fake model (`jaxengine.model.fake`) are
both just these pure functions and their weights, so the loop above never knows which it has.
"""

from __future__ import annotations

import functools
import hashlib
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxengine.model.batch import ModelBatch
from jaxengine.model.lora import LoRALayout
from scheduler.kv.groups import FULL_ATTENTION, KVCacheGroup

_SIGNATURE = "jaxengine_signature"  # the attribute `sign` sets


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


def sign[F: Callable](fn: F, *closed_over: Any) -> F:
    """Mark the model function `fn` with a signature of what it closes over (a graph, static
    settings), so that the runner can key `fn`'s saved executables without tracing it
    (jaxengine/runner/executables.py); returns `fn`.

    The signature travels with the function object: a function built otherwise has none (or
    its own), so a replaced `ModelFns.step` is never keyed as the old one. It is a hash of the
    reprs of `closed_over` (arrays in full), computed when first asked for. A function's repr
    holds a memory address, which differs from process to process: it is left out (the
    function's name stays, its code is keyed with the package's). Any other object whose repr
    is only its address says nothing of its contents, so then there is no signature.
    """
    def signature() -> str | None:
        with np.printoptions(threshold=sys.maxsize):
            text = "\0".join(map(repr, closed_over))
        text = re.sub(r"(<function [\w.<>]+) at 0x[0-9a-f]+>", r"\1>", text)
        if re.search(r" at 0x[0-9a-f]+", text):
            return None
        return hashlib.sha256(text.encode()).hexdigest()

    setattr(fn, _SIGNATURE, functools.cache(signature))
    return fn


def signature(model: ModelFns) -> str | None:
    """The signature of `model`'s step and logits functions (`sign`), or None unless both
    have one (then the runner neither saves nor loads their executables)."""
    marks = [getattr(f, _SIGNATURE, None) for f in (model.step, model.compute_logits)]
    parts = [None if mark is None else mark() for mark in marks]
    return None if None in parts else "\0".join(parts)  # type: ignore[arg-type]
