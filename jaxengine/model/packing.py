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
the same way into int8 panels with their group scales packed as panels too (`pack_int8`): about
0.28 of the float32 bytes for a decode step to read (docs/BENCHMARKS.md §2, "Quantized
projections"). GGUF Q4_1 and Q8_0 blocks (`quantization="gguf"`: `GGUFLinear`,
`GGUFEmbedder`) stay blocks, read by the native block matmul (`BlockLinear`, `BlockMLP`,
`BlockEmbedder`; q/k/v of one type merged as their rows of blocks stacked). A projection in
another format (fp8, other GGUF types, layers of mixed GGUF types) keeps its own module, and
the rest of the model packs around it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxengine.model.layers import Embedder, project
from jaxengine.model.lora import LayerLoRA
from jaxengine.model.quant.channel import dequantize
from jaxengine.model.quant.gguf import GGUFEmbedder, GGUFLinear
from jaxengine.model.quant.modules import QuantizedEmbedder, QuantizedLinear
from jaxengine_kernels.cpu import matmul, native
from jaxengine_kernels.cpu.block_matmul import BLOCK_BYTES, block_matmul, block_swiglu

# The projections `PackedLinear` packs: float32 ones and int8 ones with group scales.
Linear = nnx.Linear | QuantizedLinear


def _kind(module: nnx.Module) -> str | None:
    """What a projection (or embedding) is packed as: "float32", "int8", or its GGUF type for
    the block matmul's ("Q4_1", "Q8_0"); None for what no native kernel reads (fp8, other GGUF
    types, a module packed already)."""
    if isinstance(module, nnx.Linear | Embedder):
        return "float32"
    if isinstance(module, QuantizedLinear | QuantizedEmbedder):
        weight = module.kernel if isinstance(module, QuantizedLinear) else module.embedding
        return "int8" if weight[...].dtype == jnp.int8 else None
    if isinstance(module, GGUFLinear | GGUFEmbedder):
        return module.qtype if module.qtype in BLOCK_BYTES else None
    return None


def _scales(linears: tuple[Linear, ...]) -> jax.Array | None:
    """int8 projections' group scales side by side, f32[K/G, sum N]; None for float32 ones."""
    if isinstance(linears[0], nnx.Linear):
        return None
    return jnp.concatenate([lin.kernel_scale[...] for lin in linears], axis=1)


def _biases(linears: tuple[nnx.Module, ...]) -> nnx.Param | None:
    """The projections' biases side by side, f32[sum N] (zeros for one without); None when
    none has a bias."""
    if all(lin.bias is None for lin in linears):
        return None
    return nnx.Param(jnp.concatenate([
        jnp.zeros(lin.out_features, jnp.float32) if lin.bias is None else lin.bias[...]
        for lin in linears]))


class PackedLinear(nnx.Module):
    """`nnx.Linear`'s y = x @ kernel + bias with the kernel packed in column panels
    ([ceil(N/W), K, W], `jaxengine_kernels.cpu.matmul.pack`); float32 in and out. Made from one
    or more projections of the same input, their kernels (and biases) side by side: float32
    ones (`nnx.Linear`), or int8 ones (`QuantizedLinear`) as int8 panels with their group
    scales' panels `scale` f32[ceil(N/W), K/G, W] (None for float32)."""

    def __init__(self, *linears: Linear) -> None:
        kernels = [lin.kernel[...] for lin in linears]
        scale = _scales(linears)
        if scale is None:
            self.kernel, self.scale = nnx.Param(matmul.pack(*kernels)), None
        else:
            panels, scale_panels = matmul.pack_int8(jnp.concatenate(kernels, axis=1), scale)
            self.kernel, self.scale = nnx.Param(panels), nnx.Param(scale_panels)
        self.bias = _biases(linears)
        self.in_features = linears[0].in_features
        self.out_features = sum(lin.out_features for lin in linears)

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


def check_no_lora(lora: LayerLoRA | None) -> None:
    """A fused SwiGLU call has no gate or up output to add an adapter's update to: a model
    that serves LoRA is packed with `fuse_swiglu=False`."""
    if lora is not None:
        raise ValueError("LoRA on a fused SwiGLU MLP: pack with pack_projections(model, "
                         "fuse_swiglu=False)")


class PackedMLP(nnx.Module):
    """`layers.MLP` with gate and up packed together (`jaxengine_kernels.cpu.matmul.pack_swiglu`):
    one call gives silu(x @ gate) * (x @ up), then down_proj. The fused call
    spares writing the [T, 2F] product and XLA's pass over it (docs/BENCHMARKS.md §2, "Packed
    projections"). int8 gate and up pack as int8 panels (`pack_swiglu_int8`) with their scales'
    panels interleaved alike, `scale` (None for float32); down_proj packed as its format allows
    (`BlockMLP`'s rule)."""

    def __init__(self, mlp: nnx.Module) -> None:
        gate, up = mlp.gate_proj, mlp.up_proj  # without bias, as every MLP of the family
        if isinstance(gate, nnx.Linear):
            self.gate_up = nnx.Param(matmul.pack_swiglu(gate.kernel[...], up.kernel[...]))
            self.scale = None
        else:
            panels, scale = matmul.pack_swiglu_int8(gate.kernel[...], gate.kernel_scale[...],
                                                    up.kernel[...], up.kernel_scale[...])
            self.gate_up, self.scale = nnx.Param(panels), nnx.Param(scale)
        self.intermediate_size = gate.out_features
        self.down_proj = _packed(mlp.down_proj) or mlp.down_proj

    def __call__(self, x: jax.Array, live: jax.Array | None = None,
                 lora: LayerLoRA | None = None) -> jax.Array:
        """x f32[T, D] -> f32[T, D]; `live` as `PackedLinear`'s (padding rows come out as
        down_proj's bias). `lora` must be None: see `check_no_lora`."""
        check_no_lora(lora)
        F = self.intermediate_size
        if self.scale is None:
            hidden = matmul.packed_swiglu(x, self.gate_up[...], F, live)
        else:
            hidden = matmul.packed_swiglu_int8(x, self.gate_up[...], self.scale[...], F, live)
        return project(self.down_proj, hidden, live)


class PackedEmbedder(nnx.Module):
    """A tied embedding held once, packed as its transpose (`panels` [ceil(V'/W), D, W]): the
    LM head is then the packed matmul and a lookup gathers each token's column. A decode step
    reads the whole table for a few rows; XLA's dot over the [V', D] table reads it at a quarter
    of the packed loop's rate for one row, and a packed second copy would double it. The
    gather touches a line per element, once per step (docs/BENCHMARKS.md §2, "Packed
    projections"). An int8 table (`QuantizedEmbedder`, scales [V', D/G]) packs as int8 panels
    with its scales transposed alike, `scale` f32[ceil(V'/W), D/G, W] (None for float32)."""

    def __init__(self, embedder: nnx.Module) -> None:
        table = embedder.embedding[...]  # [V', D]
        if isinstance(embedder, QuantizedEmbedder):
            panels, scale = matmul.pack_int8(table.T, embedder.embedding_scale[...].T)
            self.panels, self.scale = nnx.Param(panels), nnx.Param(scale)
        else:
            self.panels, self.scale = nnx.Param(matmul.pack_transposed(table)), None
        self.num_embeddings = table.shape[0]

    def encode(self, ids: jax.Array) -> jax.Array:
        """Token ids i32[T] -> embeddings f32[T, D] (exactly the table's rows, dequantized as
        `QuantizedEmbedder` does for an int8 one)."""
        width = self.panels.shape[2]
        rows = self.panels[...][ids // width, :, ids % width]  # [T, D]
        if self.scale is None:
            return rows
        scale = self.scale[...][ids // width, :, ids % width]  # [T, D/G]
        return dequantize(rows, scale, axis=-1, dtype=jnp.float32)

    def decode(self, hidden: jax.Array) -> jax.Array:
        """Hidden states f32[R, D] -> f32[R, V'] logits (the tied head)."""
        if self.scale is None:
            return matmul.packed_matmul(hidden, self.panels[...], self.num_embeddings)
        return matmul.packed_matmul_int8(hidden, self.panels[...], self.scale[...],
                                         self.num_embeddings)


class BlockLinear(nnx.Module):
    """`GGUFLinear`'s y = x @ W.T + bias by the native block matmul, W's rows of Q4_1 / Q8_0
    blocks as the file stores them (`jaxengine_kernels.cpu.block_matmul`); float32 in and
    out. Made from one or more projections of the same input and type, their rows stacked."""

    def __init__(self, *linears: GGUFLinear) -> None:
        self.blocks = nnx.Param(jnp.concatenate([lin.kernel[...] for lin in linears], axis=0))
        self.qtype = linears[0].qtype
        self.bias = _biases(linears)
        self.in_features = linears[0].in_features
        self.out_features = sum(lin.out_features for lin in linears)

    def __call__(self, x: jax.Array, live: jax.Array | None = None) -> jax.Array:
        """x f32[T, K] -> f32[T, N]; `live` as `PackedLinear`'s."""
        y = block_matmul(x, self.blocks[...], self.qtype, live)
        return y if self.bias is None else y + self.bias[...]


class BlockMLP(nnx.Module):
    """`layers.MLP` with gate and up GGUF blocks of one type read by one fused call,
    silu(x @ gate.T) * (x @ up.T) (`block_swiglu`); down_proj packed as its format allows."""

    def __init__(self, mlp: nnx.Module) -> None:
        gate, up = mlp.gate_proj, mlp.up_proj  # without bias, as every MLP of the family
        self.gate, self.up = nnx.Param(gate.kernel[...]), nnx.Param(up.kernel[...])
        self.qtype = gate.qtype
        self.down_proj = _packed(mlp.down_proj) or mlp.down_proj

    def __call__(self, x: jax.Array, live: jax.Array | None = None,
                 lora: LayerLoRA | None = None) -> jax.Array:
        """x f32[T, D] -> f32[T, D]; `live` as `PackedLinear`'s; `lora` None (`check_no_lora`)."""
        check_no_lora(lora)
        hidden = block_swiglu(x, self.gate[...], self.up[...], self.qtype, live)
        return project(self.down_proj, hidden, live)


class BlockEmbedder(nnx.Module):
    """A tied `GGUFEmbedder` of Q4_1 / Q8_0 blocks whose LM head is the block matmul over its
    rows (the lookup stays the embedder's own: it dequantizes only the ids' rows)."""

    def __init__(self, embedder: GGUFEmbedder) -> None:
        self.embedder = embedder

    def encode(self, ids: jax.Array) -> jax.Array:
        """Token ids i32[T] -> embeddings f32[T, D] (`GGUFEmbedder.encode`)."""
        return self.embedder.encode(ids)

    def decode(self, hidden: jax.Array) -> jax.Array:
        """Hidden states f32[R, D] -> f32[R, V'] logits (the tied head)."""
        return block_matmul(hidden, self.embedder.embedding[...], self.embedder.qtype)


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
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    o_proj, packed = attn.o_proj, PackedLinear | BlockLinear | PackedColumns
    if isinstance(attn.q_proj, packed) or isinstance(o_proj, packed) or isinstance(
            mlp, PackedMLP | BlockMLP):
        return "the projections are packed already"  # a second model_fns over one model
    if _kind(o_proj) is None and isinstance(o_proj, QuantizedLinear):
        return (f"packed projections are float32, int8 or GGUF {' / '.join(BLOCK_BYTES)} "
                f"blocks (the weights are {jnp.dtype(o_proj.kernel[...].dtype)})")
    return native.available()


def _packed(*linears: nnx.Module) -> PackedLinear | BlockLinear | None:
    """One packed product of projections of one input and one kind (see `_kind`), or None
    when they are not all of one kind a native kernel reads."""
    kinds = {_kind(lin) for lin in linears}
    if len(kinds) != 1 or None in kinds:
        return None
    return PackedLinear(*linears) if kinds <= {"float32", "int8"} else BlockLinear(*linears)


def _merge(module: nnx.Module, names: tuple[str, ...]) -> int:
    """Replace `module`'s projections `names` (of one input) by columns of one packed product
    when they are of one kind, else each that a kernel reads by its own; returns how many
    were packed."""
    linears = [getattr(module, name) for name in names]
    if len(names) > 1 and (merged := _packed(*linears)) is not None:
        start = 0
        for name, lin in zip(names, linears, strict=True):
            setattr(module, name, PackedColumns(merged, start, start + lin.out_features))
            start += lin.out_features
        return len(names)
    count = 0
    for name, lin in zip(names, linears, strict=True):
        if (packed := _packed(lin)) is not None:
            setattr(module, name, packed)
            count += 1
    return count


def pack_projections(model: nnx.Module, *, fuse_swiglu: bool = True) -> int:
    """Swap `model`'s projections for packed ones in place; returns how many projections were
    packed (0 when `packable` says no). Without `fuse_swiglu` a SwiGLU MLP is packed as any
    other (gate and up merged, the activation in XLA), so LoRA can add to gate and up."""
    if packable(model) is not None:
        return 0
    count = 0
    for block in model.layers:
        attn = block.self_attn
        count += _merge(attn, MERGED) + _merge(attn, ("o_proj",))
        mlp = block.mlp  # None in a block of routed experts only (those stay as they are)
        if mlp is None:
            continue
        kind = _kind(mlp.gate_proj)
        if (fuse_swiglu and mlp.activation == "silu" and kind is not None
                and kind == _kind(mlp.up_proj)):
            block.mlp = PackedMLP(mlp) if kind in ("float32", "int8") else BlockMLP(mlp)
            count += 2 + (block.mlp.down_proj is not mlp.down_proj)
        else:  # the fused call is SwiGLU's: gate and up merged, the activation in XLA
            count += _merge(mlp, ("gate_proj", "up_proj")) + _merge(mlp, ("down_proj",))
    if model.lm_head is not None:
        return count + _merge(model, ("lm_head",))
    kind = _kind(model.embed_tokens)
    if kind in ("float32", "int8"):
        model.embed_tokens = PackedEmbedder(model.embed_tokens)
    elif kind is not None:
        model.embed_tokens = BlockEmbedder(model.embed_tokens)
    return count + (kind is not None)
