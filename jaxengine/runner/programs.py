"""The two jitted programs of a step: the model step (the forward pass over the packed batch,
KV cache donated) and the sampler (logits of the sampling rows, penalties, biases and grammar
masks, one token each). `programs_for(model)` jits them once per model object: runners over
the same object share their compiled executables, and they go with the model (a process that
builds engine after engine keeps none of the old ones). `STEP_NAME` and `SAMPLE_NAME` are
what compile counting keys on."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxengine.model.batch import ModelBatch
from jaxengine.model.fns import ModelFns
from jaxengine.model.lora import LoRASlots
from jaxengine.sampling.logits_processors import LogitsAdjustments, apply_logits_processors
from jaxengine.sampling.prompt_logprobs import prompt_logprobs
from jaxengine.sampling.request_tables import RequestTables, record_tokens
from jaxengine.sampling.sampler import SamplerOutput, SamplingMetadata, sample_impl
from jaxengine.structured.apply import apply_token_bitmask

STEP_NAME = "jaxengine_model_step"
SAMPLE_NAME = "jaxengine_sample"


def jaxengine_model_step(params: Any, kv: jax.Array, batch: ModelBatch, prev_tokens: jax.Array,
                         fill: jax.Array, prompt_targets: jax.Array | None = None,
                         lora: LoRASlots | None = None, *,
                         step_fn: Callable, logits_fn: Callable | None = None,
                         max_logprobs: int = 0) -> tuple[Any, ...]:
    """The model step, then the hidden rows at `logits_indices` ([R, D], a fixed shape;
    [R * (1 + K), D] under speculative decoding: jaxengine/runner/verify.py).

    Placeholder inputs (`fill` >= 0, i32[T]) take `prev_tokens[fill]` (i32[R]: the previous
    step's sampled tokens, still on the device). With `prompt_targets` (i32[T], the prompt
    token each position predicts, -1: none; the runner always passes them, None is a program
    without them) a third output: the `PromptLogprobs` of the T positions, with `max_logprobs`
    top ones, from `logits_fn` (jaxengine/sampling/prompt_logprobs.py; skipped at run time
    when no position has a target). With `lora` (the adapter slots; the batch then carries
    each token's `lora_slots`) the model adds the tokens' adapters (jaxengine/model/lora.py).
    """
    ids = jnp.where(fill >= 0, prev_tokens[jnp.maximum(fill, 0)], batch.input_ids)
    kv, hidden = step_fn(params, kv, replace(batch, input_ids=ids),
                         *(() if lora is None else (lora,)))
    extra = () if prompt_targets is None else (
        prompt_logprobs(logits_fn, params, hidden, prompt_targets, num_top=max_logprobs),)
    return kv, hidden[batch.logits_indices], *extra


def jaxengine_sample(params: Any, hidden: jax.Array, rows: jax.Array, md: SamplingMetadata,
                     adj: LogitsAdjustments, bias: jax.Array, prompt_mask: jax.Array,
                     output_counts: jax.Array, prev_tokens: jax.Array,
                     bitmask: jax.Array | None = None, *,
                     logits_fn: Callable, max_logprobs: int, num_rows: int,
                     token_sharding: NamedSharding | None
                     ) -> tuple[SamplerOutput, jax.Array, jax.Array]:
    """Logits of the sampling rows (`hidden[rows]`, f32[Rb, V]), penalties and biases (the
    `RequestTables` fields, [S, V]; `prev_tokens` i32[R], the step in flight's), the grammars'
    token bitmask (i32[Rb, ceil(V/32)], all ones: unconstrained; the runner always passes one,
    None is a program without it for callers with no grammars), then one token each; the
    tokens again, padded to i32[num_rows] where the next step's placeholders read them; and
    `output_counts` with this step's tokens counted."""
    tables = RequestTables(bias=bias, prompt_mask=prompt_mask, output_counts=output_counts)

    def adjust(logits: jax.Array) -> jax.Array:
        logits = apply_logits_processors(logits, tables, adj, prev_tokens)
        if bitmask is None:
            return logits
        # Expanding the mask costs O(Rb * V): skipped at run time when no row has a grammar.
        return jax.lax.cond(jnp.any(bitmask != -1), apply_token_bitmask, lambda x, _: x,
                            logits, bitmask)

    out = sample_impl(logits_fn(params, hidden[rows]), md, max_logprobs=max_logprobs,
                      adjust=adjust)
    tokens = jnp.zeros(num_rows, jnp.int32).at[: rows.shape[0]].set(out.token_ids)
    if token_sharding is not None:
        tokens = jax.lax.with_sharding_constraint(tokens, token_sharding)
    # Unconditional: a scatter whose indices are all dropped costs O(R) on the donated buffer.
    return out, tokens, record_tokens(tables, adj.slots, out.token_ids).output_counts


@dataclass(frozen=True, slots=True)
class ModelPrograms:
    """The step and the sampler, jitted over one model's functions (`programs_for`)."""

    # jaxengine_model_step(params, kv, batch, prev_tokens, fill, prompt_targets=None,
    # lora=None, *, max_logprobs): the KV cache donated, so the step updates it in place.
    step: Callable
    # jaxengine_sample(params, hidden, ..., *, max_logprobs, num_rows, token_sharding): the
    # output counts donated, so the sampler updates them in place.
    sample: Callable


_lock = threading.Lock()  # data-parallel replicas build their runners in threads
_programs: dict[int, ModelPrograms] = {}  # by id(model), dropped when the model is collected


def programs_for(model: ModelFns) -> ModelPrograms:
    """The jitted step and sampler over `model`'s functions, one pair per model object.

    The model's functions are bound into the jitted callables instead of passed as static
    arguments of module-level ones: JAX's caches hold static arguments, and with them every
    executable ever compiled for them, as long as the jitted function lives (a module-level
    one: the process). Bound, they go when the model is collected, executables included.
    Static are the logprobs width (of the sampler's and the step's prompt-logprobs outputs),
    R (output shapes) and where the tokens go.
    """
    key = id(model)
    with _lock:
        if key not in _programs:
            step = functools.partial(jaxengine_model_step, step_fn=model.step,
                                     logits_fn=model.compute_logits)
            sample = functools.partial(jaxengine_sample, logits_fn=model.compute_logits)
            _programs[key] = ModelPrograms(
                step=jax.jit(step, static_argnames=("max_logprobs",), donate_argnames=("kv",)),
                sample=jax.jit(sample, static_argnames=("max_logprobs", "num_rows",
                                                        "token_sharding"),
                               donate_argnames=("output_counts",)))
            weakref.finalize(model, _programs.pop, key, None)
        return _programs[key]
