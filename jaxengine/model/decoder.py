"""The decoder, common to every family, as a tree of Flax NNX modules over a paged KV cache.

`Model` holds `embed_tokens` (an `Embedder`), `layers` (the family's decoder blocks,
jaxengine/model/families/), the final `norm` and `lm_head` (None when tied to the embedding);
the leaf modules are in layers.py. Module paths follow HF's tensor names, and each family maps
one to the other in a single table (`Family.hf_names`). Layers differ only in data: their
sliding window (0 for full attention) and which RoPE table they use are per-layer inputs, so
one compiled scan runs Gemma's alternating local and global layers.

On accelerators `layers` is one block whose weights carry a leading layer axis, created by
`nnx.vmap` over split rngs and run by `nnx.scan`, so compile time does not grow with depth. On
CPU, XLA copies each scanned layer's weight slices out of the stacked arrays before the dots,
every step (docs/BENCHMARKS.md §2, "Other work in a step"), so there
`layers` is an `nnx.List` of one block per layer looped in Python (`scan_layers=False`),
paying compile time that grows with depth (about 3x for SmolLM2's 30 layers). Layer i's
weights come from its own key either way, so a seed gives the same model in both layouts.
The KV cache (`[layers, P, L, 2*K, H]`, see kv_cache.py) is passed in and returned as a value,
viewed as layers*P pages so each layer's ragged paged attention writes and reads its own pages
in place; under KV cache groups (kv_groups.py) the leading axis is the groups' layer slots and
each layer uses its group's block tables.

A model lives on a mesh (jaxengine/model/mesh.py; default: one device) and is laid out for
its "tp" size (`TPLayout`: KV heads repeated when tp > K, vocabulary padded to a multiple of
tp). Its weights are created where their sharding is declared (layers.py) and placed straight
into their shards: a fresh model is drawn by jits whose outputs have the weights' shardings
(`on_mesh`), a loaded one is filled with arrays the loader made shard by shard.
With `quantization` (jaxengine/model/quant) each block and the outer parts are built through the
weight format's module swap, so the families never see it: the abstract model, its shardings
and the loader's arrays all come out in the format.
Axes: T tokens, D model, N query heads, K kv heads, H head dim, F MLP width, V vocab, R rows;
mesh axis tp.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxengine.model.batch import ModelBatch, requests_of_step
from jaxengine.model.config import ModelConfig
from jaxengine.model.families import family
from jaxengine.model.families.family import BlockFactory, DecoderBlock, Path
from jaxengine.model.kv_cache import kv_cache_sharding
from jaxengine.model.kv_groups import kv_cache_layout
from jaxengine.model.layers import (
    COLUMN,
    Embedder,
    RMSNorm,
    linear,
    padded,
    rope_inv_freq,
    rope_tables,
)
from jaxengine.model.lora import LayerLoRA, LoRASlots, layer_lora
from jaxengine.model.mesh import make_mesh, mesh_platform, replicated, tp_size
from jaxengine.model.quant import (
    QuantizedEmbedder,
    QuantizedLinear,
    WeightFormat,
    check_platform,
    quantize_modules,
    weight_format,
)
from jaxengine.model.tensor_parallel import TPLayout, tp_layout

# The layer axis of stacked weights is not split: vmap and scan insert / remove None there.
LAYER_AXIS = {nnx.PARTITION_NAME: None}


def stacked_blocks(block: BlockFactory, cfg: ModelConfig, layout: TPLayout, keys: jax.Array,
                   *, mesh: Mesh, dtype: jnp.dtype) -> nnx.Module:
    """One `block` whose weights have a leading layer axis: `nnx.vmap` of its constructor.

    Args:
        keys: one PRNG key per layer ([Ly] key array); layer i's weights are those of
            `block(cfg, rngs=nnx.Rngs(keys[i]))`, as `looped_blocks` makes them.
    """

    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata=LAYER_AXIS)
    def create(key: jax.Array) -> nnx.Module:
        return block(cfg, layout, mesh=mesh, dtype=dtype, rngs=nnx.Rngs(key))

    return create(keys)


Build = Callable[[Callable[..., Any]], Callable[..., Any]]  # wraps a module constructor


def _as_is(create: Callable[..., Any]) -> Callable[..., Any]:
    return create


def looped_blocks(block: BlockFactory, cfg: ModelConfig, layout: TPLayout, keys: jax.Array,
                  *, mesh: Mesh, dtype: jnp.dtype, build: Build = _as_is) -> nnx.List:
    """One `block` per layer, each with its own arrays (the CPU layout); `keys` as above.

    Args:
        build: wraps the one-block constructor (`on_mesh`: each layer is drawn by the same
            compiled program).
    """
    create = build(lambda key: block(cfg, layout, mesh=mesh, dtype=dtype, rngs=nnx.Rngs(key)))
    return nnx.List([create(key) for key in keys])


def _outer_parts(cfg: ModelConfig, layout: TPLayout, key: jax.Array, *, mesh: Mesh,
                 dtype: jnp.dtype) -> dict[str, nnx.Module | None]:
    """The submodules of `Model` around the layers, drawn from `key`."""
    rngs, D, V = nnx.Rngs(key), cfg.hidden_size, cfg.vocab_size
    return {
        "embed_tokens": Embedder(V, D, mesh=mesh, dtype=dtype, rngs=rngs,
                                 padded_vocab_size=layout.vocab_size),
        "norm": RMSNorm(D, eps=cfg.rms_norm_eps, dtype=dtype,
                        offset=family(cfg.architecture).norm_offset),
        "lm_head": None if cfg.tie_word_embeddings else linear(
            D, layout.vocab_size, sharding=COLUMN, mesh=mesh, dtype=dtype, rngs=rngs,
            preferred_element_type=jnp.float32, init=lambda f: padded(f, V, axis=1)),
    }


def _create_parts(cfg: ModelConfig, layout: TPLayout, *, mesh: Mesh, dtype: jnp.dtype,
                  seed: int, scan_layers: bool, fmt: WeightFormat | None = None,
                  build: Build = _as_is) -> dict[str, nnx.Module | None]:
    """The submodules of `Model`, by attribute name, with fresh weights drawn from `seed`.

    Args:
        fmt: the weight format each block and the outer parts are built in (its modules
            made from the float ones inside the constructor, so a drawn model's float
            weights live only inside the compiled program); None: float.
        build: wraps each constructor (the outer parts, the stacked layers or one layer).
    """
    key, layer_key = jax.random.split(jax.random.key(seed))
    layer_keys = jax.random.split(layer_key, cfg.num_layers)
    block = family(cfg.architecture).block
    outer = _outer_parts
    if fmt is not None:
        block = _in_format(block, fmt, ("layers",))
        outer = _in_format(outer, fmt, ())
    if scan_layers:
        layers = build(lambda keys: stacked_blocks(block, cfg, layout, keys, mesh=mesh,
                                                   dtype=dtype))(layer_keys)
    else:
        layers = looped_blocks(block, cfg, layout, layer_keys, mesh=mesh, dtype=dtype,
                               build=build)
    outer = build(functools.partial(outer, cfg, layout, mesh=mesh, dtype=dtype))(key)
    return {**outer, "layers": layers}


def _in_format(create: Callable[..., Any], fmt: WeightFormat, path: Path
               ) -> Callable[..., Any]:
    """`create` (a block or parts constructor) whose result, at module `path`, is in weight
    format `fmt`."""
    return lambda *args, **kwargs: quantize_modules(create(*args, **kwargs), fmt, path)


def on_mesh(create: Callable[..., Any], mesh: Mesh) -> Callable[..., Any]:
    """`create(*args)` (a module constructor) run in a jit whose outputs have the weights'
    shardings: each device draws only its own shards (jax's partitionable threefry: the values
    do not depend on the mesh). Traced once, at the first call, for every call after it: one
    compiled program draws all the layers of a looped model."""
    program: dict[str, Any] = {}

    def run(*args: Any) -> Any:
        if not program:
            graphdef, abstract = nnx.split(nnx.eval_shape(create, *args))
            program["graphdef"] = graphdef
            program["jit"] = jax.jit(lambda *a: nnx.split(create(*a))[1],
                                     out_shardings=nnx.get_named_sharding(abstract, mesh))
        return nnx.merge(program["graphdef"], program["jit"](*args))

    return run


def traced_once(create: Callable[..., Any]) -> Callable[..., Any]:
    """`create` (a module constructor) called once, and its module copied for every later
    call. Only under `nnx.eval_shape`, where each copy has the shapes a call of its own would
    trace: every layer of a looped model is built alike, so its 30 layers are traced once
    (most of what `Model(weights=...)` spent before its weights went in)."""
    made: list[Any] = []

    def run(*args: Any) -> Any:
        if made:
            return nnx.clone(made[0])
        made.append(create(*args))
        return made[0]

    return run


def _layers(stacked: jax.Array | np.ndarray) -> Sequence[jax.Array | np.ndarray]:
    """A stacked weight [Ly, ...] -> its layers [...] each. A device array's come out of one
    call of one compiled program per weight's shape: a slice per layer and weight (compiled or
    dispatched each) is a start's time spent (docs/BENCHMARKS.md §14)."""
    if isinstance(stacked, jax.Array):
        return _unstack(stacked)
    return list(stacked)


@jax.jit
def _unstack(stacked: jax.Array) -> tuple[jax.Array, ...]:
    """[Ly, ...] -> Ly arrays [...]."""
    return tuple(stacked)


def _with_weights(abstract: dict[str, nnx.Module | None],
                  weights: Mapping[Path, jax.Array | np.ndarray], *, mesh: Mesh,
                  scan_layers: bool) -> dict[str, nnx.Module | None]:
    """Traced parts (`nnx.eval_shape` of `_create_parts`) with every weight from `weights`.

    `weights` is in the scanned layout; looped layers take their slice of each stacked array.
    Each lands in its variable's sharding (a no-op for arrays the loader already placed) and
    dtype (the model's for float weights; a quantized format's values and scales keep theirs).
    """
    graphdef, state = nnx.split(abstract)
    shardings = dict(nnx.to_flat_state(nnx.get_named_sharding(state, mesh)))
    filled, layers = [], {}
    for path, var in nnx.to_flat_state(state):
        looped = path[0] == "layers" and not scan_layers
        key = (path[0], *path[2:]) if looped else path
        if key not in weights:
            raise ValueError(f"weight {'.'.join(map(str, key))} is missing")
        if looped and key not in layers:
            layers[key] = _layers(weights[key])
        value = layers[key][path[1]] if looped else weights[key]
        want = var.get_value().shape
        if tuple(value.shape) != want:
            raise ValueError(f"weight {'.'.join(map(str, path))}: shape {tuple(value.shape)}, "
                             f"expected {want}")
        want_dtype = var.get_value().dtype
        if not isinstance(value, jax.Array):
            value = np.asarray(value).astype(want_dtype)
        value = jax.device_put(value, shardings[path].get_value())  # no-op if placed already
        value = value if value.dtype == want_dtype else value.astype(want_dtype)
        filled.append((path, var.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def _layer_slots(cfg: ModelConfig, batch: ModelBatch, num_slots: int
                 ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each layer's slot in the cache and its KV cache group: the groups' layout when the
    batch carries their tables, else slot i and group 0 for layer i.

    Raises:
        ValueError: the cache's leading axis is not that layout's.
    """
    if batch.group_block_tables is None:
        want, slots, groups = cfg.num_layers, tuple(range(cfg.num_layers)), (0,) * cfg.num_layers
    else:
        layout = kv_cache_layout(cfg)
        want, slots, groups = layout.num_slots, layout.layer_slot, layout.layer_group
    if num_slots != want:
        raise ValueError(f"KV cache of {num_slots} layer slots, but this batch's layout needs "
                         f"{want} (init_kv_cache(grouped=...) must match the batch's "
                         f"group_block_tables)")
    return slots, groups


def _group_batch(batch: ModelBatch, group: jax.Array | int) -> ModelBatch:
    """`batch` as a layer of KV cache group `group` reads it: that group's tables and slots."""
    if batch.group_block_tables is None:
        return batch
    return dataclasses.replace(batch, block_tables=batch.group_block_tables[group],
                               slot_mapping=batch.group_slot_mapping[group])


class Model(nnx.Module):
    """A decoder of any registered family (jaxengine/model/families) over a paged KV cache."""

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype = jnp.float32, seed: int = 0,
                 weights: Mapping[Path, jax.Array | np.ndarray] | None = None,
                 scan_layers: bool | None = None, mesh: Mesh | None = None,
                 expert_parallel: bool = False,
                 quantization: str | WeightFormat | None = None) -> None:
        """Build with random weights (`seed`) or given ones (`weights`).

        Args:
            config: the architecture.
            dtype: parameter and activation dtype (float32 or bfloat16).
            seed: seed of a fresh model's weights; ignored when `weights` is given. The same
                seed gives the same model on any mesh.
            weights: loaded arrays by module path in the scanned layout (per-layer weights
                stacked on a leading layer axis) and in this model's `layout` (KV heads
                repeated, vocabulary padded), as `jaxengine.loading.weights.load_weights`
                returns them; a fresh model is then only traced (`nnx.eval_shape`), not drawn.
            scan_layers: scan over stacked weights (True) or loop over per-layer blocks
                (False); None picks the loop on a CPU mesh and the scan on an accelerator's.
            mesh: the devices, axis "tp" (`jaxengine.make_mesh`); default: a mesh of
                jax's first device.
            expert_parallel: split a MoE model's experts whole over "tp" (vLLM's
                `enable_expert_parallel`) instead of each expert's width.
            quantization: the weight format (jaxengine/model/quant): None (float), "int8"
                or "fp8": every projection, the LM head, the embedding and MoE experts held
                quantized (norms, biases and routers float); `weights` then holds each
                matrix's values and scales as `load_weights(..., quantization=...)` makes
                them, and a fresh model is drawn in float and quantized. A GGUF file's
                format, with its weights' types (`jaxengine.loading.gguf_weights.gguf_format`),
                holds the file's blocks and takes `weights` from the same file.
        Raises:
            ModelLoadError: no family reads `config.architecture`.
            ValueError: a weight is missing from `weights` or has the wrong shape, the
                model cannot be split over the mesh's tp size, an unknown `quantization`,
                or fp8 on devices that cannot hold it.
        """
        self.config = config
        self.family = family(config.architecture)
        self.dtype = jnp.dtype(dtype)
        self.mesh = mesh or make_mesh(jax.devices()[:1])
        # The mesh's platform, not jax's default backend: an abstract TPU mesh on a CPU host
        # lowers the program a TPU runs.
        self.scan_layers = (mesh_platform(self.mesh) != "cpu" if scan_layers is None
                            else scan_layers)
        self.layout = tp_layout(config, tp_size(self.mesh), expert_parallel=expert_parallel)
        fmt = weight_format(quantization)
        if fmt is not None:
            check_platform(fmt, self.mesh)
        self.quantization = None if fmt is None else fmt.name
        create = functools.partial(_create_parts, config, self.layout, mesh=self.mesh,
                                   dtype=self.dtype, seed=seed, scan_layers=self.scan_layers,
                                   fmt=fmt)
        parts = (create(build=functools.partial(on_mesh, mesh=self.mesh)) if weights is None
                 else _with_weights(nnx.eval_shape(lambda: create(build=traced_once)), weights,
                                    mesh=self.mesh, scan_layers=self.scan_layers))
        self.embed_tokens: Embedder | QuantizedEmbedder = parts["embed_tokens"]
        self.layers: DecoderBlock | nnx.List = parts["layers"]
        self.norm: RMSNorm = parts["norm"]
        self.lm_head: nnx.Linear | QuantizedLinear | None = parts["lm_head"]

    @property
    def embed(self) -> nnx.Param:
        """The embedding table [V, D] (also the output projection when tied; a quantized
        model's values, its scales beside them); a model packed for the CPU kernels holds a
        tied table as panels instead (`PackedEmbedder`)."""
        return self.embed_tokens.embedding

    def __call__(self, kv: jax.Array, batch: ModelBatch, *, attn_impl: str = "reference",
                 interpret: bool = False, batch_invariant: bool = False,
                 kv_cache_dtype: jnp.dtype | None = None, lora: LoRASlots | None = None
                 ) -> tuple[jax.Array, jax.Array]:
        """One step over a ragged batch of prefill chunks and decodes.

        Args:
            kv: [layers, P, L, 2*K, H] the paged KV cache (its own dtype); [slots, ...] in the
                KV cache groups' layout when `batch` carries their tables.
            batch: the device batch.
            attn_impl: ragged paged attention implementation ("reference", "cpu", "tpu",
                "gpu").
            interpret: run a Pallas kernel in interpret mode (to test "tpu"/"gpu" on CPU).
            batch_invariant: the attention kernel's batch-invariant mode ("cpu" only; the rest
                of the step is batch-invariant where its projections are packed:
                jaxengine/engine/build.py `model_fns`).
            kv_cache_dtype: the dtype of the cache's values: an fp8 dtype for a uint8 `kv`
                holding their bits (`jaxengine_kernels.cache_dtype.storage_dtype`); None:
                `kv`'s own.
            lora: the LoRA adapter slots (jaxengine/model/lora.py), read at each token's
                `batch.lora_slots`; None (or a batch without them): the base model.
        Returns:
            (new kv cache, hidden [T, D] after the final norm).
        """
        cfg = self.config
        batch = requests_of_step(batch)
        x = self.embed_tokens.encode(batch.input_ids)  # [T, D]
        if self.family.embed_scale:  # sqrt(D) rounded to the activations' dtype, as HF does
            x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        rope = rope_tables(batch.positions, jnp.asarray(inv_freq))  # f32[T, H] twice
        # Sliding layers with a RoPE base of their own (Gemma 3) read a second pair of tables.
        local = tuple(w > 0 and cfg.rope_local_theta is not None for w in cfg.layer_windows)
        local_rope = rope if not any(local) else rope_tables(batch.positions, jnp.asarray(
            rope_inv_freq(cfg.head_dim, cfg.rope_local_theta, None)))
        # The kernel takes one layer's pages. Slicing layer i out of the cache (and writing it
        # back) copies [P, L, 2K, H] twice per layer, so the step's time would grow with P
        # (docs/BENCHMARKS.md §2, "Other work in a step"). Instead, view the cache as one
        # layer of layers*P pages (a free reshape) and shift layer i's page ids by i*P: the
        # kernel scatters and gathers in place.
        # With KV cache groups, layer i reads its group's tables and owns the pages of its
        # slot (kv_groups.py); without, layer i owns slot i.
        S, P, L, K2, H = kv.shape
        slot_of, group_of = _layer_slots(cfg, batch, S)
        pages = kv.reshape(S * P, L, K2, H)
        kw = {"attn_impl": attn_impl, "interpret": interpret, "batch_invariant": batch_invariant,
              "kv_cache_dtype": kv_cache_dtype}
        lora = None if batch.lora_slots is None else lora
        if isinstance(self.layers, nnx.List):
            for i, block in enumerate(self.layers):
                cos, sin = local_rope if local[i] else rope
                x, pages = block(x, pages, slot_of[i] * P, _group_batch(batch, group_of[i]),
                                 cos, sin, i, lora=layer_lora(lora, i, batch.lora_slots), **kw)
        else:
            # The adapter slots are layer-first, like the stacked weights: scanned beside them.
            @nnx.scan(in_axes=(nnx.Carry, 0, 0, 0), out_axes=nnx.Carry,
                      transform_metadata=LAYER_AXIS)
            def run(carry: tuple[jax.Array, jax.Array], block: DecoderBlock, layer: jax.Array,
                    ab: tuple[dict, dict]) -> tuple[jax.Array, jax.Array]:
                x, pages = carry
                is_local = jnp.asarray(local)[layer]
                cos, sin = rope if not any(local) else (
                    jnp.where(is_local, a, b) for a, b in zip(local_rope, rope, strict=True))
                one = None if lora is None else LayerLoRA(
                    a=ab[0], b=ab[1], scaling=lora.scaling, token_slots=batch.lora_slots)
                return block(x, pages, jnp.asarray(slot_of)[layer] * P,
                             _group_batch(batch, jnp.asarray(group_of)[layer]), cos, sin,
                             layer, lora=one, **kw)

            x, pages = run((x, pages), self.layers,
                           jnp.arange(cfg.num_layers, dtype=jnp.int32),
                           ({}, {}) if lora is None else (lora.a, lora.b))
        # The cache comes back in the sharding it came in, so its donated buffers are reused.
        kv = jax.lax.with_sharding_constraint(pages.reshape(S, P, L, K2, H),
                                              kv_cache_sharding(self.mesh))
        # The residual stream is replicated (each row-parallel projection all-reduces).
        return kv, jax.lax.with_sharding_constraint(self.norm(x), replicated(self.mesh))

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Project hidden [R, D] to f32[R, V] logits (tied embeddings use `embed_tokens`),
        soft-capped when the config says so (Gemma 2), so sampling, logprobs, scores and
        drafts all see the capped logits.

        The projection is vocab-parallel ([R, V'] split over tp); the logits are then gathered
        whole onto every device and cut to the real vocabulary, so the sampler sees exactly
        what one device would (R x V floats: small next to the weights).
        """
        head = self.embed_tokens.decode if self.lm_head is None else self.lm_head
        logits = jax.lax.with_sharding_constraint(head(hidden), replicated(self.mesh))
        logits = logits[:, : self.config.vocab_size]
        cap = self.config.final_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)
