"""The quantized counterparts of the float modules: `QuantizedLinear`, `QuantizedEmbedder`
and `QuantizedExperts`, each made from the float module it replaces.

Each keeps the float module's weight name for its values (`kernel`, `embedding`, `gate_proj`,
...) and adds `<name>_scale` beside it, so a checkpoint tensor maps to the same module path
either way. Values are split over the mesh exactly as the float weight was and scales as the
axes they keep: per output channel (fp8) a column-parallel kernel's scales [out] are split
with its columns, a row-parallel kernel's are replicated, the embedding's per-row scales [V']
split with its rows; in groups (int8) the scales keep every axis, [in / 32, out] or
[V', D / 32], and are split exactly as the values; a stacked weight's leading layer and expert
axes stay on the scales (docs/STYLE.md rule 17: the sharding is declared where the weight is
created, here from the float weight's).

In groups (int8) the values are dequantized into the dot's operand (values * scale, which
XLA fuses into the dot). Per output channel (fp8) the product is scaled per output channel
after the dot; where the matrix units multiply fp8 (TPU v5p and later, NVIDIA compute
capability 8.9 and up: `formats.multiplies_fp8`) a projection's activations are quantized to
fp8 too, one scale per token (vLLM's dynamic per-token scheme for per-channel fp8 weights), and
the dot is fp8 x fp8 accumulating in float32; elsewhere (CPU, older TPUs and GPUs) the values
are converted to the activation dtype inside the dot. The embedding's gather, the tied LM head
and the MoE experts stay weight-only everywhere.
Axes: T tokens, D model, F expert width, E experts, V' the padded vocabulary.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

from jaxengine.model.layers import Embedder, vocab_parallel_rows
from jaxengine.model.moe import Experts
from jaxengine.model.quant.channel import FP8, ChannelFormat, dequantize, quantize

KERNEL_AXIS = -2  # a kernel [..., in, out] contracts its in axis: one scale per column
EMBEDDING_AXIS = -1  # the embedding [V', D] contracts D as the tied head: one scale per row


def scale_name(name: str) -> str:
    """The name of the scales of weight `name`."""
    return f"{name}_scale"


def shards(axes: tuple | None, mesh: Mesh | AbstractMesh | None, axis: int, ndim: int) -> int:
    """The parts axis `axis` of a weight of `ndim` axes is split in over `mesh` by its sharding
    `axes` (a PartitionSpec's entries, trailing ones may be left out; None: not split)."""
    axis %= ndim
    if axes is None or mesh is None or axis >= len(axes):
        return 1
    names = axes[axis]
    names = () if names is None else (names,) if isinstance(names, str) else names
    return math.prod(mesh.shape[n] for n in names)


def _like(weight: nnx.Variable, value: jax.Array, *, drop: int | None = None) -> nnx.Param:
    """A Param holding `value`, split over the mesh as `weight` is, less axis `drop`."""
    meta = weight.get_metadata()
    sharding = meta.get("out_sharding")
    if sharding is None:
        return nnx.Param(value)
    axes = list(sharding)
    if drop is not None:
        del axes[drop]
    return nnx.Param(value, out_sharding=tuple(axes), mesh=meta.get("mesh"))


def _quantized(module: nnx.Module, name: str, fmt: ChannelFormat, axis: int) -> None:
    """Replace `module`'s float weight `name` by its values and scales (`<name>_scale`)."""
    weight = getattr(module, name)
    meta = weight.get_metadata()
    split = shards(meta.get("out_sharding"), meta.get("mesh"), axis, len(weight.shape))
    values, scale = quantize(weight[...], fmt, axis=axis, shards=split, xp=jnp)
    setattr(module, name, _like(weight, values))
    grouped = fmt.group is not None  # the scales keep the contracted axis, in groups
    setattr(module, scale_name(name), _like(weight, scale, drop=None if grouped else axis))


def grouped(values: jax.Array, scale: jax.Array) -> bool:
    """Whether `scale` holds groups along the contracted axis (int8) rather than one scale
    per output channel (fp8): it keeps every axis of `values`."""
    return scale.ndim == values.ndim


class QuantizedLinear(nnx.Module):
    """`nnx.Linear` with a quantized kernel: y = (x @ kernel) * kernel_scale + bias.

    `kernel` [in, out] int8 with `kernel_scale` f32[in / 32, out] (y = x @ (kernel * scale)),
    or float8_e4m3fn with f32[out]; the bias float. The dot accumulates in float32; the result
    is in `preferred_element_type` (float32 for logits) or the activation dtype, as the float
    layer's.
    """

    def __init__(self, linear: nnx.Linear, fmt: ChannelFormat, *, fp8_dots: bool = False
                 ) -> None:
        """The projection `linear` with its kernel quantized in `fmt` (per output column);
        `fp8_dots`: an fp8 kernel meets x quantized to fp8 per token (fp8 x fp8 dots)."""
        self.kernel = linear.kernel
        _quantized(self, "kernel", fmt, KERNEL_AXIS)
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype, self.preferred_element_type = linear.dtype, linear.preferred_element_type
        self.fp8_dots = fp8_dots

    def __call__(self, x: jax.Array, live: jax.Array | None = None) -> jax.Array:
        """x [T, in] -> [T, out]. `live` is `layers.project`'s; XLA's dot computes every row."""
        del live
        x = x.astype(self.dtype)
        kernel, scale = self.kernel[...], self.kernel_scale[...]
        if grouped(kernel, scale):
            w = dequantize(kernel, scale, axis=KERNEL_AXIS, dtype=self.dtype)
            y = jnp.dot(x, w, preferred_element_type=jnp.float32)
        elif self.fp8_dots:
            # each token's row quantized as a weight's channel is: its largest magnitude to
            # 448 (under a mesh that splits `in`, the row maximum is one all-reduce)
            xq, x_scale = quantize(x, FP8, axis=-1, xp=jnp)  # f8[T, in], f32[T]
            y = jnp.dot(xq, kernel, preferred_element_type=jnp.float32) * x_scale[:, None] * scale
        else:
            y = jnp.dot(x, kernel.astype(self.dtype), preferred_element_type=jnp.float32) * scale
        y = y.astype(self.preferred_element_type or self.dtype)
        return y if self.bias is None else y + self.bias[...]


class QuantizedEmbedder(nnx.Module):
    """`layers.Embedder` with the table quantized: `embedding` [V', D] and `embedding_scale`
    f32[V', D / 32] (int8) or f32[V'] (fp8, per row), vocab-parallel; tied, also the quantized
    LM head."""

    def __init__(self, embedder: Embedder, fmt: ChannelFormat) -> None:
        """`embedder`'s table quantized in `fmt` along D (each row its scales)."""
        self.dtype = embedder.embedding[...].dtype
        self.embedding = embedder.embedding
        _quantized(self, "embedding", fmt, EMBEDDING_AXIS)
        self.mesh = embedder.mesh

    def encode(self, ids: jax.Array) -> jax.Array:
        """Token ids i32[T] -> embeddings [T, D] (rows dequantized)."""

        def lookup(rows: jax.Array, values: jax.Array, scale: jax.Array) -> jax.Array:
            return dequantize(jnp.take(values, rows, axis=0), jnp.take(scale, rows, axis=0),
                              axis=EMBEDDING_AXIS, dtype=self.dtype)

        return vocab_parallel_rows(self.mesh, ids, lookup, self.embedding[...],
                                   self.embedding_scale[...])

    def decode(self, hidden: jax.Array) -> jax.Array:
        """Hidden states [R, D] -> f32[R, V'] logits against the table (tied head)."""
        table, scale = self.embedding[...], self.embedding_scale[...]
        if grouped(table, scale):
            table = dequantize(table, scale, axis=EMBEDDING_AXIS, dtype=hidden.dtype)
            return jnp.einsum("rd,vd->rv", hidden, table, preferred_element_type=jnp.float32)
        logits = jnp.einsum("rd,vd->rv", hidden, table.astype(hidden.dtype),
                            preferred_element_type=jnp.float32)
        return logits * scale


EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def _scale_spec(spec: P, values: jax.Array, scale: jax.Array) -> P:
    """The split of a kernel's scales from the kernel's [..., in, out]: the same in groups,
    without the in axis per output channel."""
    return spec if grouped(values, scale) else P(*spec[:-2], spec[-1])


class QuantizedExperts(nnx.Module):
    """`moe.Experts` quantized along each expert's inputs: `gate_proj`, `up_proj` [E, D, F]
    and `down_proj` [E, F, D] values with scales [E, D / 32, F], [E, D / 32, F] and
    [E, F / 32, D] (int8), or per output column [E, F], [E, F] and [E, D] (fp8).

    The grouped matmul reads float matrices, so each device dequantizes its experts inside the
    step before it (`matrices`): the weights rest quantized in memory, and the float copy lives
    for one layer's experts at a time.
    """

    def __init__(self, experts: Experts, fmt: ChannelFormat) -> None:
        """`experts`' three weights quantized in `fmt`."""
        for name in EXPERT_WEIGHTS:
            setattr(self, name, getattr(experts, name))
            _quantized(self, name, fmt, KERNEL_AXIS)
        self.gate_up_spec, self.down_spec = experts.gate_up_spec, experts.down_spec

    def operands(self) -> tuple[tuple[jax.Array, P], ...]:
        """Values and scales of gate, up and down, each with its split over "tp"."""
        specs = (self.gate_up_spec, self.gate_up_spec, self.down_spec)
        pairs = []
        for name, spec in zip(EXPERT_WEIGHTS, specs, strict=True):
            values, scale = getattr(self, name)[...], getattr(self, scale_name(name))[...]
            pairs += [(values, spec), (scale, _scale_spec(spec, values, scale))]
        return tuple(pairs)

    @staticmethod
    def matrices(*local: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One device's gate, up and down in `dtype` from its blocks of `operands()`."""
        gate, up, down = (dequantize(values, scale, axis=KERNEL_AXIS, dtype=dtype)
                          for values, scale in zip(local[::2], local[1::2], strict=True))
        return gate, up, down
