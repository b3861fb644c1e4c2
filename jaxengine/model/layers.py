"""Leaf layers shared by the decoder families: pure functions of arrays and small NNX modules.

The functions (norm, RoPE) take plain arrays; the modules (`RMSNorm`, `Embedder`, `Attention`,
`MLP`) take plain numbers (no config), so a test can build one alone. Each module's constructor
is the one place its weights are created and where their sharding over the mesh axis "tp" is
declared (docs/STYLE.md rule 17): column-parallel q/k/v and gate/up, row-parallel o and down
(GSPMD adds one all-reduce after each), a vocab-parallel embedding and LM head, norms
replicated. Modules with sharded weights take the mesh they are placed on; those that need
collectives of their own (`Embedder.encode`, attention) run per device under `jax.shard_map`.
Fresh weights are N(0, 0.02) matrices, unit norm scales and zero biases, drawn at the
checkpoint's sizes, so a model laid out for tp devices (KV heads repeated, vocabulary padded:
jaxengine/model/tensor_parallel.py) holds the same values as for one. Numerics follow HF
transformers: norms and RoPE tables in float32, results cast back to the activation dtype.
Projections are `nnx.Linear` with 2-D kernels [in, out]: plain dots over free reshapes (with head
axes in the dot, XLA on CPU chose a layout that transposed the output projection every layer).
Axes: T tokens, D model, N query heads, K kv heads, H head dim, F MLP width, V vocab, R rows;
mesh axis tp.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxengine.model.batch import ModelBatch
from jaxengine.model.config import RopeScaling
from jaxengine.model.kv_rotation import rotate
from jaxengine.model.lora import LayerLoRA
from jaxengine.model.mesh import TP_AXIS
from jaxengine.model.reductions import fixed_order_sum
from jaxengine_kernels import ragged_paged_attention
from jaxengine_kernels.cache_dtype import FP8_DTYPES

Init = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]
Sharding = tuple[str | None, ...]  # mesh axis (or None: not split) of each array axis
COLUMN: Sharding = (None, TP_AXIS)  # kernel [in, out] split on out: no collective
ROW: Sharding = (TP_AXIS, None)  # kernel [in, out] split on in: partial sums, one all-reduce
HEADS = P(None, TP_AXIS, None)  # q/k/v [T, heads, H] under shard_map
PAGES = P(None, None, TP_AXIS, None)  # one layer's pages [P, L, 2*K, H]: split on heads


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm over the last axis, as HF does it: normalise in f32, then scale by `weight` in
    x's dtype (Llama) or by `offset + weight` in f32 (Gemma's `1 + w`, offset 1).

    Args:
        x: [..., D] activations.
        weight: [D] scale.
    Returns:
        [..., D] in x's dtype.
    """
    x32 = x.astype(jnp.float32)
    # A fixed order of the sum: a row's norm does not depend on the rows beside it.
    mean_square = fixed_order_sum(x32 * x32)[..., None] / x.shape[-1]
    x32 = x32 * jax.lax.rsqrt(mean_square + eps)
    if offset:
        return (x32 * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse RoPE frequencies f32[H/2], with llama3 scaling applied when given."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv.astype(np.float32)
    if scaling.kind == "linear":
        return (inv / scaling.factor).astype(np.float32)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin f32[T, H] for `positions` i32[T] (HF's non-interleaved half layout).

    The tables are materialised once (an optimization barrier): left to itself, XLA's CPU
    backend fuses cos and sin into every layer's RoPE multiply and evaluates them again for
    each head and layer (docs/BENCHMARKS.md §2, "Other work in a step").
    """
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [T, H]
    return jax.lax.optimization_barrier((jnp.cos(angles), jnp.sin(angles)))


# Jitted, like `fixed_order_sum`, so that a step traces it once per shape rather than at each
# of its two calls a layer; XLA inlines the call.
@jax.jit
def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [T, heads, H] by the tables cos/sin f32[T, H]; result in x's dtype.

    HF's x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] written as the
    halves swapped ([x2, x1], a reversal XLA fuses) times a sign folded into sin: one pass
    over x, where the rotated copy cost XLA's CPU backend slices, a negation and a
    concatenation first (the same float operations).
    """
    half = x.shape[-1] // 2
    swapped = jnp.flip(x.reshape(*x.shape[:-1], 2, half), axis=-2).reshape(x.shape)
    signed_sin = jnp.concatenate([-sin[:, :half], sin[:, half:]], axis=-1)
    cos, signed_sin = cos[:, None, :].astype(x.dtype), signed_sin[:, None, :].astype(x.dtype)
    return x * cos + swapped * signed_sin


@functools.cache
def _sharded_attention(mesh: Mesh, **kernel: Any) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """The attention kernel with `kernel`'s static arguments, under `shard_map` over `mesh`,
    jitted: every layer of the same settings calls this one function, so a step traces the
    kernel once per shape, not once a layer (XLA inlines the call). Its arguments: q, k, v,
    pages, slots, block tables, seq lens, query start locs, num seqs, window, k and v scales.
    """
    def attend(*a: jax.Array) -> tuple[jax.Array, jax.Array]:
        return ragged_paged_attention(*a[:-3], sliding_window=a[-3], k_scale=a[-2],
                                      v_scale=a[-1], **kernel)

    return jax.jit(jax.shard_map(
        attend, mesh=mesh, in_specs=(HEADS, HEADS, HEADS, PAGES, *[P()] * 8),
        out_specs=(HEADS, PAGES), check_vma=False))  # kernels' loop carries start unvaried


def _normal(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    """N(0, 0.02) drawn in float32, then cast (the same values in every dtype)."""
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _zeros(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    del key  # an initializer's signature; zeros need no randomness
    return jnp.zeros(shape, dtype)


def padded(init: Init, size: int, axis: int) -> Init:
    """`init` drawn with `size` entries on `axis`, then zero-padded to the asked shape (the
    vocabulary padded to a multiple of tp: the padding rows hold zeros)."""

    def draw(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
        real = init(key, (*shape[:axis], size, *shape[axis + 1:]), dtype)
        pad = [(0, 0)] * len(shape)
        pad[axis] = (0, shape[axis] - size)
        return jnp.pad(real, pad)

    return draw


def head_repeated(init: Init, repeat: int, head_dim: int) -> Init:
    """`init` drawn for 1/`repeat` of the heads on the last axis ([..., heads*H]), each head
    then repeated `repeat` times in place (KV heads replicated when tp > K)."""

    def draw(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
        real = init(key, (*shape[:-1], shape[-1] // repeat), dtype)
        heads = real.reshape(*shape[:-1], -1, head_dim)
        return jnp.repeat(heads, repeat, axis=-2).reshape(shape)

    return draw


def linear(in_features: int, out_features: int, *, sharding: Sharding, mesh: Mesh,
           dtype: jnp.dtype, rngs: nnx.Rngs, use_bias: bool = False,
           preferred_element_type: jnp.dtype | None = None,
           init: Callable[[Init], Init] = lambda f: f) -> nnx.Linear:
    """`nnx.Linear` with kernel [in, out] and bias [out] in `dtype`, initialised as HF does here.

    Args:
        sharding: the kernel's mesh axes, `COLUMN` or `ROW`; the bias follows the out axis.
        mesh: the devices the weights are placed on.
        preferred_element_type: accumulation and result dtype of the dot (float32 for logits).
        init: wraps both initializers (`padded`, `head_repeated`) to lay the weights out.
    """
    kernel = nnx.with_partitioning(init(_normal), sharding, mesh=mesh)
    bias = nnx.with_partitioning(init(_zeros), sharding[1:], mesh=mesh)
    return nnx.Linear(in_features, out_features, use_bias=use_bias, dtype=dtype,
                      param_dtype=dtype, kernel_init=kernel, bias_init=bias,
                      preferred_element_type=preferred_element_type, rngs=rngs)


def per_layer(values: tuple[Any, ...], layer: jax.Array | int) -> Any:
    """`values[layer]`: a Python value for a looped layer, a traced one for a scanned layer
    (what differs between the layers of one stack: a window, a routed or dense FFN)."""
    return values[layer] if isinstance(layer, int) else jnp.asarray(values)[layer]


def live_tokens(batch: ModelBatch) -> jax.Array:
    """i32[] the batch's scheduled tokens; the rows after them are the bucket's padding."""
    return batch.query_start_loc[batch.num_seqs]


def project(proj: nnx.Module, x: jax.Array, live: jax.Array | None,
            lora: LayerLoRA | None = None, name: str = "") -> jax.Array:
    """`proj(x)` for x [T, in], plus the LoRA update of module `name` from `lora` (the one
    place adapters apply, whatever the projection's weight format). A projection packed for
    the CPU's native matmul (jaxengine/model/packing.py) is also told the `live` rows and
    skips the padding after them, whose outputs are then the bias; XLA's dots compute every
    row."""
    y = proj(x) if isinstance(proj, nnx.Linear) or live is None else proj(x, live)
    return y if lora is None else lora.add(name, x, y)


def vocab_parallel_rows(mesh: Mesh, ids: jax.Array,
                        lookup: Callable[..., jax.Array], *tables: jax.Array) -> jax.Array:
    """Embeddings [T, D] of token ids i32[T] from `tables` split over "tp" on their vocabulary
    axis 0 (an embedding [V', D] and what comes with it, such as its scales [V', ...]).

    vLLM's VocabParallelEmbedding: each device looks up the ids in its own rows,
    `lookup(local_rows i32[T], *local_tables) -> [T, D]`, zeros for the ids of other devices,
    and one all-reduce sums them; exact, since one device adds each row.
    """

    def local(ids: jax.Array, *tables: jax.Array) -> jax.Array:  # tables [V'/tp, ...]
        rows = tables[0].shape[0]
        offset = ids - jax.lax.axis_index(TP_AXIS) * rows
        mine = (offset >= 0) & (offset < rows)
        x = lookup(jnp.where(mine, offset, 0), *tables)
        return jax.lax.psum(jnp.where(mine[:, None], x, 0), TP_AXIS)

    specs = [P(TP_AXIS, *[None] * (t.ndim - 1)) for t in tables]
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), *specs), out_specs=P())(ids, *tables)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis with a learned `scale` [dim]; `offset` as `rms_norm`'s."""

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype, offset: float = 0.0) -> None:
        # A fresh norm is the identity: scale 1 (stored as 0 when the model adds 1).
        self.scale = nnx.Param(jnp.full((dim,), 1.0 - offset, dtype))
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., dim] -> normalised and scaled [..., dim] in x's dtype."""
        return rms_norm(x, self.scale[...], self.eps, self.offset)


class Embedder(nnx.Module):
    """The token embedding `embedding` [V', D], vocab-parallel (each device holds V'/tp rows);
    with tied weights also the output projection."""

    def __init__(self, vocab_size: int, hidden_size: int, *, mesh: Mesh, dtype: jnp.dtype,
                 rngs: nnx.Rngs, padded_vocab_size: int | None = None) -> None:
        """`padded_vocab_size` V' >= V rows (a multiple of tp), the rows past V zero."""
        shape = (padded_vocab_size or vocab_size, hidden_size)
        init = nnx.with_partitioning(padded(_normal, vocab_size, axis=0), ROW, mesh=mesh)
        self.embedding = nnx.Param(init(rngs.params(), shape, dtype))
        self.mesh = mesh

    def encode(self, ids: jax.Array) -> jax.Array:
        """Token ids i32[T] -> embeddings [T, D]."""
        return vocab_parallel_rows(self.mesh, ids, lambda rows, table: jnp.take(
            table, rows, axis=0), self.embedding[...])

    def decode(self, hidden: jax.Array) -> jax.Array:
        """Hidden states [R, D] -> f32[R, V'] logits against the embedding (tied head), split
        over the vocabulary like the table."""
        return jnp.einsum("rd,vd->rv", hidden, self.embedding[...],
                          preferred_element_type=jnp.float32)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE over the paged KV cache (q/k/v/o projections,
    optional q/k bias and q/k RMSNorm, a sliding window and score soft-capping)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 qkv_bias: bool, qk_norm: bool, eps: float, mesh: Mesh, dtype: jnp.dtype,
                 rngs: nnx.Rngs, kv_repeat: int = 1, sm_scale: float | None = None,
                 soft_cap: float | None = None, norm_offset: float = 0.0,
                 windows: tuple[int, ...] = (),
                 kv_scales: tuple[tuple[float, float], ...] = ()) -> None:
        """`num_kv_heads` K of the checkpoint; with `kv_repeat` r the k/v projections (and the
        cache) have K*r heads, each checkpoint head repeated r times (tp > K). `sm_scale`
        (default head_dim**-0.5) and `soft_cap` as the kernel's; `norm_offset` is the q/k
        norms' (`RMSNorm`); `windows` each layer's sliding window W (0: full attention; empty:
        full on every layer); `kv_scales` each layer's (k_scale, v_scale) for an fp8 cache
        (empty: 1.0 on every layer)."""
        D, N, K, H = hidden_size, num_heads, num_kv_heads * kv_repeat, head_dim
        kv_init = functools.partial(head_repeated, repeat=kv_repeat, head_dim=H)
        column = functools.partial(linear, sharding=COLUMN, mesh=mesh, use_bias=qkv_bias,
                                   dtype=dtype, rngs=rngs)
        self.q_proj = column(D, N * H)
        self.k_proj = column(D, K * H, init=kv_init)
        self.v_proj = column(D, K * H, init=kv_init)
        self.o_proj = linear(N * H, D, sharding=ROW, mesh=mesh, dtype=dtype, rngs=rngs)
        norm = functools.partial(RMSNorm, H, eps=eps, dtype=dtype, offset=norm_offset)
        self.q_norm = norm() if qk_norm else None
        self.k_norm = norm() if qk_norm else None
        self.num_heads, self.num_kv_heads, self.head_dim = N, K, H
        self.sm_scale = H**-0.5 if sm_scale is None else sm_scale
        self.soft_cap, self.windows, self.kv_scales = soft_cap, windows, kv_scales
        self.mesh = mesh

    def __call__(self, x: jax.Array, pages: jax.Array, page_offset: jax.Array | int,
                 batch: ModelBatch, cos: jax.Array, sin: jax.Array,
                 layer: jax.Array | int = 0, *, attn_impl: str, interpret: bool = False,
                 batch_invariant: bool = False, kv_cache_dtype: jnp.dtype | None = None,
                 lora: LayerLoRA | None = None) -> tuple[jax.Array, jax.Array]:
        """Attend the batch's tokens to their context, writing their K/V into `pages` first.

        Args:
            x: [T, D] normalised inputs.
            pages: [P', L, 2*K, H] pages the kernel sees; page p of the batch is
                `page_offset + p` (each layer owns a range of pages, see `Model.__call__`).
            cos, sin: f32[T, H] RoPE tables of the batch's positions.
            layer: the layer's index (an i32[] when the layers are scanned: its window is
                then a traced operand, so one program serves layers of different windows).
            attn_impl: ragged paged attention implementation ("reference", "cpu", "tpu",
                "gpu").
            interpret: run a Pallas kernel in interpret mode (to test "tpu"/"gpu" on CPU).
            batch_invariant: the kernel's batch-invariant mode ("cpu" only).
            kv_cache_dtype: the dtype of the values in `pages` (an fp8 dtype for uint8 pages
                of their bits); None: `pages`' own. An fp8 cache holds rotated keys
                (`kv_rotation.py`).
            lora: the layer's LoRA slots and the tokens' adapters (None: no adapters).
        Returns:
            (output [T, D], updated pages).
        """
        T = x.shape[0]
        N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
        live = live_tokens(batch)
        q = project(self.q_proj, x, live, lora, "q_proj").reshape(T, N, H)
        k = project(self.k_proj, x, live, lora, "k_proj").reshape(T, K, H)
        v = project(self.v_proj, x, live, lora, "v_proj").reshape(T, K, H)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        fp8 = jnp.dtype(kv_cache_dtype or pages.dtype) in FP8_DTYPES
        if fp8:
            q, k = rotate(q), rotate(k)  # the same scores, less fp8 error (kv_rotation.py)
        slots = batch.slot_mapping + page_offset * pages.shape[1]
        # Per device, over its own heads: the kernels never see the mesh. Query head n reads
        # KV head n // (N/K) globally, and device d holds query heads d*N/tp.. and KV heads
        # d*K/tp.., so the local rule n // (N/K) holds too. The batch metadata is replicated.
        attend = _sharded_attention(self.mesh, sm_scale=self.sm_scale, soft_cap=self.soft_cap,
                                    impl=attn_impl, interpret=interpret,
                                    batch_invariant=batch_invariant,
                                    kv_cache_dtype=kv_cache_dtype)
        window = per_layer(self.windows, layer) if self.windows else 0
        k_scale, v_scale = self._kv_scales(fp8, layer)
        out, pages = attend(q, k, v, pages, slots, batch.block_tables + page_offset,
                            batch.seq_lens, batch.query_start_loc, batch.num_seqs,
                            jnp.asarray(window, jnp.int32), k_scale, v_scale)
        return project(self.o_proj, out.astype(x.dtype).reshape(T, N * H), live, lora,
                       "o_proj"), pages

    def _kv_scales(self, fp8: bool, layer: jax.Array | int) -> tuple[jax.Array, jax.Array]:
        """f32[] (k_scale, v_scale) of `layer`: the checkpoint's for an fp8 cache (`fp8`),
        1.0 for a float one, which holds k and v as they are (vLLM applies the scales only to
        fp8 caches)."""
        if not self.kv_scales or not fp8:
            return jnp.float32(1.0), jnp.float32(1.0)
        pair = per_layer(self.kv_scales, layer)  # (2,) for a looped layer, f32[2] scanned
        return jnp.asarray(pair[0], jnp.float32), jnp.asarray(pair[1], jnp.float32)


# HF activation name -> function (the gate of a gated MLP)
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


class MLP(nnx.Module):
    """Gated MLP: gate_proj, up_proj [D, F] and down_proj [F, D]; SwiGLU with "silu",
    GeGLU with "gelu_pytorch_tanh" (Gemma)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, mesh: Mesh,
                 dtype: jnp.dtype, rngs: nnx.Rngs, activation: str = "silu") -> None:
        D, F = hidden_size, intermediate_size
        self.activation = activation
        self.gate_proj = linear(D, F, sharding=COLUMN, mesh=mesh, dtype=dtype, rngs=rngs)
        self.up_proj = linear(D, F, sharding=COLUMN, mesh=mesh, dtype=dtype, rngs=rngs)
        self.down_proj = linear(F, D, sharding=ROW, mesh=mesh, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, live: jax.Array | None = None,
                 lora: LayerLoRA | None = None) -> jax.Array:
        """x [T, D] -> [T, D]; `live` (i32[]) and `lora` as `project`'s."""
        gate = ACTIVATIONS[self.activation](project(self.gate_proj, x, live, lora, "gate_proj"))
        hidden = gate * project(self.up_proj, x, live, lora, "up_proj")
        return project(self.down_proj, hidden, live, lora, "down_proj")
