"""The Llama-family decoder in Flax NNX, layers scanned over stacked weights (or looped).

Every per-layer weight is given with a leading layer axis. By default on accelerators the
forward pass is a `jax.lax.scan` over them, so compile time does not grow with depth. On CPU,
XLA copies each layer's weight slices out of the stacked arrays before the dots, every step (a
16-token SmolLM2 step: 160 ms scanned, 110 ms looped, 2-core CPU), so there the module keeps one
array per layer and loops over the layers in Python (`scan_layers=False`), paying compile time
that grows with depth (about 3x for SmolLM2's 30 layers).
The KV cache (`[layers, P, L, 2*K, H]`, see kv_cache.py) is viewed as layers*P pages so each
layer's ragged paged attention writes and reads its own pages in place.
Axes: T tokens, D model, N query heads, K kv heads, H head dim, F MLP width, V vocab.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.model.batch import ModelBatch
from jaxengine.model.config import ModelConfig
from jaxengine.model.layers import apply_rope, gated_mlp, rms_norm, rope_inv_freq, rope_tables
from pallas_kernels import ragged_paged_attention


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every weight, by our name; per-layer weights carry a leading layer axis."""
    Ly, D, F, N, K, H, V = (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size,
                            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)
    shapes = {
        "embed": (V, D), "final_norm": (D,),
        "attn_norm": (Ly, D), "wq": (Ly, D, N, H), "wk": (Ly, D, K, H), "wv": (Ly, D, K, H),
        "wo": (Ly, N, H, D), "mlp_norm": (Ly, D),
        "w_gate": (Ly, D, F), "w_up": (Ly, D, F), "w_down": (Ly, F, D),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (D, V)
    if cfg.qkv_bias:
        shapes.update(bq=(Ly, N, H), bk=(Ly, K, H), bv=(Ly, K, H))
    if cfg.qk_norm:
        shapes.update(q_norm=(Ly, H), k_norm=(Ly, H))
    return shapes


GLOBAL_WEIGHTS = ("embed", "final_norm", "lm_head")  # every other weight is per layer


def random_weights(cfg: ModelConfig, *, seed: int, dtype: jnp.dtype) -> dict[str, np.ndarray]:
    """Host weights for a fresh model: N(0, 0.02) matrices, unit norms, zero biases.

    Drawn with numpy on the host: eager `jax.random` would compile once per weight shape.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("norm"):
            w = np.ones(shape, np.float32)
        elif name.startswith("b"):
            w = np.zeros(shape, np.float32)
        else:
            w = 0.02 * rng.standard_normal(shape, np.float32)
        out[name] = w.astype(dtype)
    return out


class Model(nnx.Module):
    """Llama / Mistral / Qwen2 / Qwen3 decoder over a paged KV cache."""

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype = jnp.float32, seed: int = 0,
                 weights: Mapping[str, jax.Array | np.ndarray] | None = None,
                 scan_layers: bool | None = None) -> None:
        """Build with random weights (`seed`) or given ones (`weights`, by `weight_shapes` name).

        Args:
            config: the architecture.
            dtype: parameter and activation dtype (float32 or bfloat16).
            seed: seed of a fresh model's weights; ignored when `weights` is given.
            weights: loaded arrays; shapes must match `weight_shapes(config)`.
            scan_layers: scan over stacked weights (True) or loop over per-layer arrays
                (False); None picks the loop on CPU and the scan elsewhere.
        """
        self.config = config
        self.dtype = jnp.dtype(dtype)
        shapes = weight_shapes(config)
        if weights is None:
            weights = random_weights(config, seed=seed, dtype=self.dtype)
        for name, shape in shapes.items():
            if tuple(weights[name].shape) != shape:
                raise ValueError(f"weight {name}: shape {tuple(weights[name].shape)}, "
                                 f"expected {shape}")
        self.embed = nnx.Param(jnp.asarray(weights["embed"], self.dtype))
        self.final_norm = nnx.Param(jnp.asarray(weights["final_norm"], self.dtype))
        self.lm_head = (None if config.tie_word_embeddings
                        else nnx.Param(jnp.asarray(weights["lm_head"], self.dtype)))
        self.layer_names = tuple(n for n in shapes if n not in GLOBAL_WEIGHTS)
        if scan_layers is None:
            scan_layers = jax.default_backend() != "cpu"
        self.scan_layers = scan_layers
        if scan_layers:
            self.layers = nnx.Dict({n: nnx.Param(jnp.asarray(weights[n], self.dtype))
                                    for n in self.layer_names})
        else:
            self.layers = nnx.List([
                nnx.Dict({n: nnx.Param(jnp.asarray(weights[n][i], self.dtype))
                          for n in self.layer_names})
                for i in range(config.num_layers)
            ])

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
        x = jnp.take(self.embed[...], batch.input_ids, axis=0)  # [T, D]
        inv_freq = jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
        cos, sin = rope_tables(batch.positions, inv_freq)  # f32[T, H]
        # The kernel takes one layer's pages. Slicing layer i out of the cache (and writing it
        # back) copies [P, L, 2K, H] twice per layer, so the step's time grew with P (measured
        # 0.44 s -> 0.99 s for P = 64 -> 1024 on SmolLM2, CPU). Instead, view the cache as one
        # layer of layers*P pages (a free reshape) and shift layer i's page ids by i*P: the
        # kernel scatters and gathers in place.
        Ly, P, L, K2, H = kv.shape
        pages = kv.reshape(Ly * P, L, K2, H)
        if not self.scan_layers:
            for i, layer in enumerate(self.layers):
                w = {n: layer[n][...] for n in self.layer_names}
                x, pages = decoder_layer(x, pages, i * P, w, batch, cos, sin, cfg, attn_impl,
                                         interpret)
        else:
            def body(carry: tuple[jax.Array, jax.Array],
                     xs: tuple[dict[str, jax.Array], jax.Array]
                     ) -> tuple[tuple[jax.Array, jax.Array], None]:
                x, pages = carry
                w, layer = xs
                x, pages = decoder_layer(x, pages, layer * P, w, batch, cos, sin, cfg,
                                         attn_impl, interpret)
                return (x, pages), None

            stacked = {n: self.layers[n][...] for n in self.layer_names}
            layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
            (x, pages), _ = jax.lax.scan(body, (x, pages), (stacked, layer_ids))
        kv = pages.reshape(Ly, P, L, K2, H)
        return kv, rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Project hidden [R, D] to f32[R, V] logits (tied embeddings use `embed`)."""
        if self.lm_head is None:
            return jnp.einsum("rd,vd->rv", hidden, self.embed[...],
                              preferred_element_type=jnp.float32)
        return jnp.einsum("rd,dv->rv", hidden, self.lm_head[...],
                          preferred_element_type=jnp.float32)


def decoder_layer(x: jax.Array, pages: jax.Array, page_offset: jax.Array | int,
                  w: Mapping[str, jax.Array], batch: ModelBatch, cos: jax.Array, sin: jax.Array,
                  cfg: ModelConfig, attn_impl: str, interpret: bool = False
                  ) -> tuple[jax.Array, jax.Array]:
    """One pre-norm decoder layer.

    Args:
        x: [T, D] residual stream.
        pages: [P', L, 2*K, H] pages the kernel sees; this layer's page p is `page_offset + p`.
        page_offset: added to the batch's page ids (layer * P, see `Model.__call__`).
    Returns:
        (x [T, D], updated pages).
    """
    eps = cfg.rms_norm_eps
    h = rms_norm(x, w["attn_norm"], eps)
    T, D = x.shape
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    # Plain 2-D dots over weights viewed [D, heads*H] / [N*H, D] (free reshapes): with head
    # axes in the dot, XLA on CPU chose a layout that transposed `wo` in every looped layer.
    q = (h @ w["wq"].reshape(D, N * H)).reshape(T, N, H)
    k = (h @ w["wk"].reshape(D, K * H)).reshape(T, K, H)
    v = (h @ w["wv"].reshape(D, K * H)).reshape(T, K, H)
    if cfg.qkv_bias:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    if cfg.qk_norm:
        q, k = rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    slots = batch.slot_mapping + page_offset * pages.shape[1]
    out, pages = ragged_paged_attention(
        q, k, v, pages, slots, batch.block_tables + page_offset, batch.seq_lens,
        batch.query_start_loc, batch.num_seqs, sm_scale=cfg.head_dim**-0.5, impl=attn_impl,
        interpret=interpret)
    x = x + out.astype(x.dtype).reshape(T, N * H) @ w["wo"].reshape(N * H, D)
    h = rms_norm(x, w["mlp_norm"], eps)
    return x + gated_mlp(h, w["w_gate"], w["w_up"], w["w_down"]), pages
