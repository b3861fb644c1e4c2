"""The jit boundary of the model: pure `model_step` and `compute_logits` over an NNX state.

Built once from `graphdef, state = nnx.split(model)`; the engine jits them with
`jax.jit(step, donate_argnames=("kv",))` so the KV cache is updated in place, and compiles
the step once per token bucket (T) since every other batch shape is fixed.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.model.batch import ModelBatch, RequestChunk, pack_batch
from jaxengine.model.decoder import Model
from jaxengine.model.fns import sign
from jaxengine.model.lora import LoRASlots

__all__ = ["ModelBatch", "RequestChunk", "make_compute_logits", "make_model_step",
           "pack_batch", "split_model"]

ModelStep = Callable[[nnx.State, jax.Array, ModelBatch], tuple[jax.Array, jax.Array]]
ComputeLogits = Callable[[nnx.State, jax.Array], jax.Array]


def split_model(model: Model) -> tuple[nnx.GraphDef, nnx.State]:
    """`nnx.split(model)`: the static graph (closed over by the step) and the weight state."""
    return nnx.split(model)


def make_model_step(graphdef: nnx.GraphDef, *, attn_impl: str = "reference",
                    interpret: bool = False, batch_invariant: bool = False,
                    kv_cache_dtype: jnp.dtype | None = None) -> ModelStep:
    """The pure step `model_step(state, kv, batch) -> (kv, hidden)`.

    Args:
        graphdef: from `nnx.split(model)`.
        attn_impl: ragged paged attention implementation; closed over (a static choice).
        interpret: run a Pallas kernel in interpret mode (CPU tests of "tpu"/"gpu").
        batch_invariant: the attention kernel's batch-invariant mode (`Model.__call__`).
        kv_cache_dtype: the dtype of the cache's values (`Model.__call__`); closed over.
    Returns:
        A function of (state, kv [layers, P, L, 2*K, H], batch, lora=None) returning the new
        cache and the final-norm hidden states [T, D]; jit it with `donate_argnames=("kv",)`.
        `lora` is the adapter slots (`jaxengine.model.lora.LoRASlots`) the batch's
        `lora_slots` index.
    """

    def model_step(state: nnx.State, kv: jax.Array, batch: ModelBatch,
                   lora: LoRASlots | None = None) -> tuple[jax.Array, jax.Array]:
        model = nnx.merge(graphdef, state)
        return model(kv, batch, attn_impl=attn_impl, interpret=interpret,
                     batch_invariant=batch_invariant, kv_cache_dtype=kv_cache_dtype,
                     lora=lora)

    return sign(model_step, "model_step", graphdef, attn_impl, interpret, batch_invariant,
                kv_cache_dtype)


def make_compute_logits(graphdef: nnx.GraphDef) -> ComputeLogits:
    """The pure `compute_logits(state, hidden) -> f32[R, V]`.

    `hidden` is [R, D]: the step's hidden rows at `batch.logits_indices`
    (`hidden[batch.logits_indices]`), so logits are only computed for sampled tokens.
    """

    def compute_logits(state: nnx.State, hidden: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state).logits(hidden)

    return sign(compute_logits, "compute_logits", graphdef)
