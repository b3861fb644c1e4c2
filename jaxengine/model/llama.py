"""The Llama-family decoder as a tree of Flax NNX modules over a paged KV cache.

`Model` holds `embed_tokens` (an `Embedder`), `layers` (decoder `Block`s: input_layernorm,
self_attn, post_attention_layernorm, mlp), the final `norm` and `lm_head` (None when tied to the
embedding); the leaf modules are in layers.py. Module paths follow HF's tensor names, and
jaxengine/loading/weights.py maps one to the other in a single table.

On accelerators `layers` is one `Block` whose weights carry a leading layer axis, created by
`nnx.vmap` over split rngs and run by `nnx.scan`, so compile time does not grow with depth. On
CPU, XLA copies each scanned layer's weight slices out of the stacked arrays before the dots,
every step (a 16-token SmolLM2 step: 160 ms scanned, 110 ms looped, 2-core CPU), so there
`layers` is an `nnx.List` of one `Block` per layer looped in Python (`scan_layers=False`),
paying compile time that grows with depth (about 3x for SmolLM2's 30 layers). Layer i's
weights come from its own key either way, so a seed gives the same model in both layouts.
The KV cache (`[layers, P, L, 2*K, H]`, see kv_cache.py) is passed in and returned as a value,
viewed as layers*P pages so each layer's ragged paged attention writes and reads its own pages
in place.
Axes: T tokens, D model, N query heads, K kv heads, H head dim, F MLP width, V vocab, R rows.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.model.batch import ModelBatch
from jaxengine.model.config import ModelConfig
from jaxengine.model.layers import (
    MLP,
    Attention,
    Embedder,
    RMSNorm,
    linear,
    rope_inv_freq,
    rope_tables,
)

Path = tuple[str | int, ...]  # a weight's module path, e.g. ("layers", "mlp", "up_proj", "kernel")


class Block(nnx.Module):
    """One pre-norm decoder layer: attention then MLP, each added to the residual stream."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(D, eps=eps, dtype=dtype)
        self.self_attn = Attention(D, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm, eps=eps,
                                   dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(D, eps=eps, dtype=dtype)
        self.mlp = MLP(D, cfg.intermediate_size, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, pages: jax.Array, page_offset: jax.Array | int,
                 batch: ModelBatch, cos: jax.Array, sin: jax.Array, *, attn_impl: str,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
        """x [T, D] -> (x [T, D], updated pages); pages and page_offset as in `Attention`."""
        out, pages = self.self_attn(self.input_layernorm(x), pages, page_offset, batch, cos,
                                    sin, attn_impl=attn_impl, interpret=interpret)
        x = x + out
        return x + self.mlp(self.post_attention_layernorm(x)), pages


def stacked_blocks(cfg: ModelConfig, keys: jax.Array, *, dtype: jnp.dtype) -> Block:
    """One `Block` whose weights have a leading layer axis: `nnx.vmap` of its constructor.

    Args:
        keys: one PRNG key per layer ([Ly] key array); layer i's weights are those of
            `Block(cfg, rngs=nnx.Rngs(keys[i]))`, as `looped_blocks` makes them.
    """

    @nnx.vmap(in_axes=0, out_axes=0)
    def create(key: jax.Array) -> Block:
        return Block(cfg, dtype=dtype, rngs=nnx.Rngs(key))

    return create(keys)


def looped_blocks(cfg: ModelConfig, keys: jax.Array, *, dtype: jnp.dtype) -> nnx.List:
    """One `Block` per layer, each with its own arrays (the CPU layout); `keys` as above."""
    return nnx.List([Block(cfg, dtype=dtype, rngs=nnx.Rngs(key)) for key in keys])


def _create_parts(cfg: ModelConfig, *, dtype: jnp.dtype, seed: int, scan_layers: bool
                  ) -> dict[str, nnx.Module | None]:
    """The submodules of `Model`, by attribute name, with fresh weights drawn from `seed`."""
    key, layer_key = jax.random.split(jax.random.key(seed))
    rngs, layer_keys = nnx.Rngs(key), jax.random.split(layer_key, cfg.num_layers)
    blocks = stacked_blocks if scan_layers else looped_blocks
    return {
        "embed_tokens": Embedder(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs),
        "layers": blocks(cfg, layer_keys, dtype=dtype),
        "norm": RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype),
        "lm_head": None if cfg.tie_word_embeddings else linear(
            cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs,
            preferred_element_type=jnp.float32),
    }


def _with_weights(abstract: dict[str, nnx.Module | None],
                  weights: Mapping[Path, jax.Array | np.ndarray], *, dtype: jnp.dtype,
                  scan_layers: bool) -> dict[str, nnx.Module | None]:
    """Traced parts (`nnx.eval_shape` of `_create_parts`) with every weight from `weights`.

    `weights` is in the scanned layout; looped layers take their slice of each stacked array.
    """
    graphdef, state = nnx.split(abstract)
    filled = []
    for path, var in nnx.to_flat_state(state):
        looped = path[0] == "layers" and not scan_layers
        key = (path[0], *path[2:]) if looped else path
        if key not in weights:
            raise ValueError(f"weight {'.'.join(map(str, key))} is missing")
        value = weights[key][path[1]] if looped else weights[key]
        want = var.get_value().shape
        if tuple(value.shape) != want:
            raise ValueError(f"weight {'.'.join(map(str, path))}: shape {tuple(value.shape)}, "
                             f"expected {want}")
        filled.append((path, var.replace(jnp.asarray(value, dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


class Model(nnx.Module):
    """Llama / Mistral / Qwen2 / Qwen3 decoder over a paged KV cache."""

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype = jnp.float32, seed: int = 0,
                 weights: Mapping[Path, jax.Array | np.ndarray] | None = None,
                 scan_layers: bool | None = None) -> None:
        """Build with random weights (`seed`) or given ones (`weights`).

        Args:
            config: the architecture.
            dtype: parameter and activation dtype (float32 or bfloat16).
            seed: seed of a fresh model's weights; ignored when `weights` is given.
            weights: loaded arrays by module path in the scanned layout (per-layer weights
                stacked on a leading layer axis), as `jaxengine.loading.weights.load_weights`
                returns them; a fresh model is then only traced (`nnx.eval_shape`), not drawn.
            scan_layers: scan over stacked weights (True) or loop over per-layer blocks
                (False); None picks the loop on CPU and the scan elsewhere.
        Raises:
            ValueError: a weight is missing from `weights` or has the wrong shape.
        """
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.scan_layers = jax.default_backend() != "cpu" if scan_layers is None else scan_layers
        create = functools.partial(_create_parts, config, dtype=self.dtype, seed=seed,
                                   scan_layers=self.scan_layers)
        parts = (create() if weights is None
                 else _with_weights(nnx.eval_shape(create), weights, dtype=self.dtype,
                                    scan_layers=self.scan_layers))
        self.embed_tokens: Embedder = parts["embed_tokens"]
        self.layers: Block | nnx.List = parts["layers"]
        self.norm: RMSNorm = parts["norm"]
        self.lm_head: nnx.Linear | None = parts["lm_head"]

    @property
    def embed(self) -> nnx.Param:
        """The embedding table [V, D] (also the output projection when tied)."""
        return self.embed_tokens.embedding

    def __call__(self, kv: jax.Array, batch: ModelBatch, *, attn_impl: str = "reference",
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
        """One step over a ragged batch of prefill chunks and decodes.

        Args:
            kv: [layers, P, L, 2*K, H] the paged KV cache (model dtype).
            batch: the device batch.
            attn_impl: ragged paged attention implementation ("reference", "tpu", "gpu").
            interpret: run a Pallas kernel in interpret mode (to test "tpu"/"gpu" on CPU).
        Returns:
            (new kv cache, hidden [T, D] after the final norm).
        """
        cfg = self.config
        x = self.embed_tokens.encode(batch.input_ids)  # [T, D]
        inv_freq = jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
        cos, sin = rope_tables(batch.positions, inv_freq)  # f32[T, H]
        # The kernel takes one layer's pages. Slicing layer i out of the cache (and writing it
        # back) copies [P, L, 2K, H] twice per layer, so the step's time grew with P (measured
        # 0.44 s -> 0.99 s for P = 64 -> 1024 on SmolLM2, CPU). Instead, view the cache as one
        # layer of layers*P pages (a free reshape) and shift layer i's page ids by i*P: the
        # kernel scatters and gathers in place.
        Ly, P, L, K2, H = kv.shape
        pages = kv.reshape(Ly * P, L, K2, H)
        kw = {"attn_impl": attn_impl, "interpret": interpret}
        if isinstance(self.layers, nnx.List):
            for i, block in enumerate(self.layers):
                x, pages = block(x, pages, i * P, batch, cos, sin, **kw)
        else:
            @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
            def run(carry: tuple[jax.Array, jax.Array], block: Block, layer: jax.Array
                    ) -> tuple[jax.Array, jax.Array]:
                x, pages = carry
                return block(x, pages, layer * P, batch, cos, sin, **kw)

            x, pages = run((x, pages), self.layers, jnp.arange(Ly, dtype=jnp.int32))
        return pages.reshape(Ly, P, L, K2, H), self.norm(x)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Project hidden [R, D] to f32[R, V] logits (tied embeddings use `embed_tokens`)."""
        if self.lm_head is None:
            return self.embed_tokens.decode(hidden)
        return self.lm_head(hidden)
