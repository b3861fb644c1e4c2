"""Projections packed for the native CPU matmul (jaxengine_kernels/cpu/matmul.py).

On the CPU a decode step reads every projection's weights from memory for a few rows; packed in
contiguous column panels, the same weights stream faster through the native loop than a [K, N]
kernel through XLA's dots (or through the same loop reading [K, N] in short strided runs).
`pack_projections(model)` swaps each layer's projections in place for packed ones: q/k/v
merged into one `PackedLinear` (their kernels side by side) that each reads its columns of
(`PackedColumns`), o and the LM head alone (a tied one with the embedding: `PackedEmbedder`),
and a SwiGLU MLP as a `PackedMLP` (gate/up interleaved into one SwiGLU call, then down; another
activation's gate/up merged like q/k/v, the activation left to XLA; routed experts are
not packed: jaxengine_kernels/grouped_matmul.py has their CPU kernel); the
weights are not duplicated. It applies where the kernel runs and pays: a one-device CPU mesh,
float32 activations, layers looped in Python (the CPU layout), and a C++ compiler on the machine
(`packable` says why not otherwise). Against XLA's dots, as fast at one row and faster from a
few rows up to a prefill chunk (docs/BENCHMARKS.md §2, "Packed projections").

Weights quantized to int8 (`quantization="int8"`: `QuantizedLinear`, `QuantizedEmbedder`) pack
the same way into int8 panels with their per-column scales (`pack_int8`): a quarter of the
float32 bytes for a decode step to read (docs/BENCHMARKS.md §2, "Quantized projections"). A
projection in another format (fp8) keeps its own module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxengine.model.quant.modules import QuantizedEmbedder, QuantizedLinear
from jaxengine_kernels.cpu import matmul, native

# The projections `pack_projections` packs: float32 ones and int8 ones with column scales.
Linear = nnx.Linear | QuantizedLinear


def _packs(linear: nnx.Module) -> bool:
    """Whether `linear` is a projection the packed matmul takes (an fp8 one is not). A model's
    projections are all of one format, and its embedding too."""
    return isinstance(linear, nnx.Linear) or (isinstance(linear, QuantizedLinear)
                                              and linear.kernel[...].dtype == jnp.int8)


def _scales(linears: tuple[Linear, ...]) -> jax.Array | None:
    """int8 projections' column scales side by side, f32[sum N]; None for float32 ones."""
    if isinstance(linears[0], nnx.Linear):
        return None
    return jnp.concatenate([lin.kernel_scale[...] for lin in linears])


class PackedLinear(nnx.Module):
    """`nnx.Linear`'s y = x @ kernel + bias with the kernel packed in column panels
    ([ceil(N/W), K, W], `jaxengine_kernels.cpu.matmul.pack`); float32 in and out. Made from one
    or more projections of the same input, their kernels (and biases) side by side: float32
    ones (`nnx.Linear`), or int8 ones (`QuantizedLinear`) as int8 panels with their column
    scales `scale` f32[N] (None for float32)."""

    def __init__(self, *linears: Linear) -> None:
        kernel = jnp.concatenate([lin.kernel[...] for lin in linears], axis=1)
        self.scale = None if (scale := _scales(linears)) is None else nnx.Param(scale)
        self.kernel = nnx.Param(matmul.pack(kernel) if self.scale is None
                                else matmul.pack_int8(kernel))
        biased = any(lin.bias is not None for lin in linears)
        self.bias = nnx.Param(jnp.concatenate([
            jnp.zeros(lin.out_features, jnp.float32) if lin.bias is None else lin.bias[...]
            for lin in linears])) if biased else None
        self.in_features, self.out_features = kernel.shape

    def __call__(self, x: jax.Array, live: jax.Array | None = None) -> jax.Array:
        """x f32[T, K] -> f32[T, N]; with `live` (i32[]) only the first `live` rows are
        computed, the padding rows after them come out as the bias (zeros without one)."""
        if self.scale is None:
            y = matmul.packed_matmul(x, self.kernel[...], self.out_features, live)
        else:
            y = matmul.packed_matmul_int8(x, self.kernel[...], self.scale[...],
                                          self.out_features, live)
        return y if self.bias is None else y + self.bias[...]


class PackedColumns(nnx.Module):
    """One projection of a merged `PackedLinear`: columns [start, stop) of its product. The
    merged product appears once per caller, and XLA's common-subexpression pass keeps one of
    the identical custom calls, so q/k/v (gate/up) cost one call (a test counts them)."""

    def __init__(self, merged: PackedLinear, start: int, stop: int) -> None:
        self.merged, self.start, self.stop = merged, start, stop

    def __call__(self, x: jax.Array, live: jax.Array | None = None) -> jax.Array:
        """x f32[T, K] -> f32[T, stop - start]; `live` as `PackedLinear`'s."""
        return self.merged(x, live)[..., self.start:self.stop]


class PackedMLP(nnx.Module):
    """`layers.MLP` with gate and up packed together (`jaxengine_kernels.cpu.matmul.pack_swiglu`):
    one call gives silu(x @ gate) * (x @ up), and down_proj is a `PackedLinear`. The fused call
    spares writing the [T, 2F] product and XLA's pass over it (docs/BENCHMARKS.md §2, "Packed
    projections"). int8 gate and up pack as int8 panels (`pack_swiglu_int8`) with their scales
    side by side, `scale` f32[2F] (None for float32)."""

    def __init__(self, mlp: nnx.Module) -> None:
        gate, up = mlp.gate_proj, mlp.up_proj  # without bias, as every MLP of the family
        self.scale = None if (scale := _scales((gate, up))) is None else nnx.Param(scale)
        pack = matmul.pack_swiglu if self.scale is None else matmul.pack_swiglu_int8
        self.gate_up = nnx.Param(pack(gate.kernel[...], up.kernel[...]))
        self.intermediate_size = gate.out_features
        self.down_proj = PackedLinear(mlp.down_proj)

    def __call__(self, x: jax.Array, live: jax.Array | None = None) -> jax.Array:
        """x f32[T, D] -> f32[T, D]; `live` as `PackedLinear`'s (padding rows come out as
        down_proj's bias)."""
        F = self.intermediate_size
        if self.scale is None:
            hidden = matmul.packed_swiglu(x, self.gate_up[...], F, live)
        else:
            hidden = matmul.packed_swiglu_int8(x, self.gate_up[...], self.scale[...], F, live)
        return self.down_proj(hidden, live)


class PackedEmbedder(nnx.Module):
    """A tied embedding held once, packed as its transpose (`panels` [ceil(V'/W), D, W]): the
    LM head is then the packed matmul and a lookup gathers each token's column. A decode step
    reads the whole table for a few rows; XLA's dot over the [V', D] table reads it at a quarter
    of the packed loop's rate for one row, and a packed second copy would double it. The
    gather touches a line per element, once per step (docs/BENCHMARKS.md §2, "Packed
    projections"). An int8 table (`QuantizedEmbedder`, a scale per row) packs as int8 panels
    with the rows' scales, `scale` f32[V'] (None for float32): the head's column scales."""

    def __init__(self, embedder: nnx.Module) -> None:
        table = embedder.embedding[...]  # [V', D]
        int8 = isinstance(embedder, QuantizedEmbedder)
        self.scale = nnx.Param(embedder.embedding_scale[...]) if int8 else None
        self.panels = nnx.Param(matmul.pack_int8(table.T) if int8 else matmul.pack(table.T))
        self.num_embeddings = table.shape[0]

    def encode(self, ids: jax.Array) -> jax.Array:
        """Token ids i32[T] -> embeddings f32[T, D] (exactly the table's rows, dequantized as
        `QuantizedEmbedder` does for an int8 one)."""
        width = self.panels.shape[2]
        rows = self.panels[...][ids // width, :, ids % width]
        if self.scale is None:
            return rows
        return rows.astype(jnp.float32) * self.scale[...][ids][:, None]

    def decode(self, hidden: jax.Array) -> jax.Array:
        """Hidden states f32[R, D] -> f32[R, V'] logits (the tied head)."""
        if self.scale is None:
            return matmul.packed_matmul(hidden, self.panels[...], self.num_embeddings)
        return matmul.packed_matmul_int8(hidden, self.panels[...], self.scale[...],
                                         self.num_embeddings)


# q/k/v merged into one packed product (one call and more panels to share between the
# threads: SmolLM2's k/v have 3 panels each), o alone; the MLP is a `PackedMLP`.
MERGED = ("q_proj", "k_proj", "v_proj")


def packable(model: nnx.Module) -> str | None:
    """None when `pack_projections` applies to `model`, else why not (one line)."""
    mesh = model.mesh  # an AbstractMesh (lowering for absent devices) has no platform
    if not isinstance(mesh, Mesh) or mesh.size != 1 or mesh.devices.flat[0].platform != "cpu":
        return "packed projections are for a one-device CPU mesh"
    if jnp.dtype(model.dtype) != jnp.float32:
        return f"packed projections are float32 (the model is {jnp.dtype(model.dtype)})"
    if not isinstance(model.layers, nnx.List):
        return "packed projections need the looped layer layout (scan_layers=False)"
    if any(isinstance(block.self_attn.o_proj, PackedLinear) for block in model.layers):
        return "the projections are packed already"  # a second model_fns over one model
    if not _packs(model.layers[0].self_attn.o_proj):
        kind = jnp.dtype(model.layers[0].self_attn.o_proj.kernel[...].dtype)
        return f"packed projections are float32 or int8 (the weights are {kind})"
    return native.available()


def _merge(module: nnx.Module, names: tuple[str, ...]) -> None:
    """Replace `module`'s projections `names` (of one input, each float32 or each int8) by
    columns of one `PackedLinear` of their kernels side by side."""
    linears = [getattr(module, name) for name in names]
    merged, start = PackedLinear(*linears), 0
    for name, lin in zip(names, linears, strict=True):
        setattr(module, name, PackedColumns(merged, start, start + lin.out_features))
        start += lin.out_features


def pack_projections(model: nnx.Module) -> int:
    """Swap `model`'s projections for packed ones in place; returns how many projections were
    packed (0 when `packable` says no)."""
    if packable(model) is not None:
        return 0
    count = 0
    for block in model.layers:
        attn = block.self_attn
        _merge(attn, MERGED)
        attn.o_proj = PackedLinear(attn.o_proj)
        count += len(MERGED) + 1
        mlp = block.mlp  # None in a block of routed experts only (those stay as they are)
        if mlp is None:
            continue
        if mlp.activation == "silu":
            block.mlp = PackedMLP(mlp)
        else:  # the fused call is SwiGLU's: gate and up merged, the activation in XLA
            _merge(mlp, ("gate_proj", "up_proj"))
            mlp.down_proj = PackedLinear(mlp.down_proj)
        count += 3  # gate, up, down
    if model.lm_head is None:
        model.embed_tokens = PackedEmbedder(model.embed_tokens)
    else:
        model.lm_head = PackedLinear(model.lm_head)
    return count + 1
