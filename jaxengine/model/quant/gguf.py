"""Projections and the token embedding served from GGUF blocks (`quantization="gguf"`).

The weights stay on the device as the file stores them, u8[out, row_bytes] rows of blocks
(jaxengine_kernels/gguf_blocks.py), and are dequantized inside the jitted step, right
before their dot: never stored as floats. `GGUFLinear` replaces an `nnx.Linear` (kernel
[in, out]) with the same product, y = x @ W.T in x's dtype with float32 accumulation;
`GGUFEmbedder` replaces the `Embedder`, gathering the ids' rows of blocks and dequantizing only
those, and, tied, is also the LM head. Values equal those of the same file dequantized to
float32 (and then cast to the model's dtype) as the float loader does. A projection whose
layers mix types keeps one array of every layer's rows in slots, each layer's type beside it
(`GGUFLinear`; the reasons in docs/DESIGN.md, "Quantized weights").

Sharding follows the float weights': a column-parallel projection (q/k/v, gate/up) and the
vocab-parallel embedding split their rows; a row-parallel one (o, down) splits each row's bytes
at block boundaries, so in/tp must be whole blocks (refused otherwise). Each device dequantizes
only its own blocks (`jax.shard_map`); a row-parallel product sums its partial results over tp
as the float one does. Laid out for tp the blocks are as the floats: KV heads' rows repeated,
the vocabulary padded with zero rows, which dequantize to zeros in every type.
Axes: T tokens, I in features, O out features, D model, V' padded vocabulary, R rows;
mesh axis tp.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxengine.model.families.family import Path
from jaxengine.model.layers import COLUMN, ROW, Embedder, Sharding, vocab_parallel_rows
from jaxengine.model.mesh import TP_AXIS, tp_size
from jaxengine.model.tensor_parallel import TPLayout
from jaxengine_kernels.gguf_blocks import (
    SlotLayout,
    block_format,
    dequantize,
    dequantize_slots,
    slot_layout,
)

Q = gguf.GGMLQuantizationType


def blocks_sharding(kernel: Sharding, ndim: int) -> Sharding:
    """The mesh axes of blocks u8[..., O, row_bytes] (`ndim` axes, leading ones a layer or
    expert axis, not split) holding a kernel [I, O] of sharding `kernel` (`COLUMN`/`ROW`)."""
    return (None,) * (ndim - 2) + tuple(reversed(kernel))


QTypes = Q | int | str | Sequence[Q | int | str]  # one GGUF type, or a weight's mix of them


def _types(qtype: QTypes) -> tuple[Q | int | str, ...]:
    return tuple(qtype) if isinstance(qtype, Sequence) and not isinstance(qtype, str) else (
        qtype,)


def row_bytes(in_features: int, qtype: QTypes) -> int:
    """Bytes of one row of `in_features` values in `qtype`'s blocks (a mix of types: in the
    slots holding any of them, `gguf_blocks.SlotLayout`).

    Raises:
        ValueError: `in_features` is not a whole number of blocks (of slots).
    """
    layout = slot_layout(_types(qtype))
    if in_features % layout.values:
        raise ValueError(f"rows of {in_features} values are not whole {'/'.join(layout.qtypes)}"
                         f" blocks of {layout.values}")
    return in_features // layout.values * layout.slot_bytes


def qtype_name(name: str) -> str:
    """The name of the per-layer type index of weight `name` whose layers mix types."""
    return f"{name}_qtype"


class GGUFLinear(nnx.Module):
    """`nnx.Linear`'s y = x @ kernel + bias with the kernel held as GGUF blocks.

    A weight whose layers mix types (llama.cpp's "_M" mixes) holds every layer's rows in the
    slots of `gguf_blocks.SlotLayout` and, in `kernel_qtype` (i32, a leading layer axis when
    stacked), each layer's type as an index into `layout.qtypes`: a scanned stack of layers
    stays one array and one compiled body, each layer dequantizing by its own type
    (`lax.switch`).
    """

    def __init__(self, blocks: jax.Array, qtype: QTypes, *, sharding: Sharding,
                 mesh: Mesh, bias: jax.Array | None = None,
                 preferred_element_type: jnp.dtype | None = None,
                 which: jax.Array | None = None) -> None:
        """Hold `blocks` placed in their shards.

        Args:
            blocks: u8[..., O, row_bytes] the weight [O, I] as GGUF rows of blocks (leading
                axes: stacked layers, as scanned layers hold them); several types: in slots.
            qtype: the blocks' GGUF type (one with a dequantizer in gguf_blocks.py), or the
                types a mixed weight's layers use.
            sharding: the float kernel's mesh axes, `COLUMN` (split O) or `ROW` (split I).
            mesh: the devices the blocks are placed on.
            bias: [..., O] float, split like O; None for none.
            preferred_element_type: the result's dtype (float32 for logits); None: x's.
            which: i32[...] (`blocks`' leading axes) each layer's type, an index into the
                types, for several types; None: zeros.
        Raises:
            ValueError: an unsupported `qtype`, or a row-parallel weight whose I/tp is not a
                multiple of the type's block size (of a mix's slot).
        """
        layout = slot_layout(_types(qtype))
        *lead, out_features, row_bytes = blocks.shape
        names = "/".join(layout.qtypes)
        if row_bytes % layout.slot_bytes:
            raise ValueError(f"{names} rows of {row_bytes} bytes are not whole blocks of "
                             f"{layout.slot_bytes} bytes")
        self.in_features = row_bytes // layout.slot_bytes * layout.values
        self.out_features, self.layout = out_features, layout
        # the one type the blocks are in, as the native block matmul reads it; None for a mix
        self.qtype = layout.qtypes[0] if len(layout.qtypes) == 1 else None
        tp = tp_size(mesh)
        if sharding == ROW and (self.in_features // tp) % layout.values:
            raise ValueError(
                f"a row-parallel {names} weight of {self.in_features} input features "
                f"cannot be split over tensor_parallel_size={tp} at {layout.values}-value "
                f"block boundaries: tensor_parallel_size must divide "
                f"{self.in_features // layout.values} (load with quantization=None to "
                "dequantize it instead)")
        axes = blocks_sharding(sharding, blocks.ndim)
        self.kernel = nnx.Param(blocks, sharding_names=axes, mesh=mesh)
        if self.qtype is None:
            which = jnp.zeros(lead, jnp.int32) if which is None else which
            # replicated, as the norms (an empty sharding would not gain the layer axis)
            self.kernel_qtype = nnx.Param(which)
        self.bias = None if bias is None else nnx.Param(
            bias, sharding_names=axes[:-2] + (sharding[1],), mesh=mesh)
        self.sharding, self.mesh = sharding, mesh
        self.preferred_element_type = preferred_element_type

    def __call__(self, x: jax.Array, live: jax.Array | None = None) -> jax.Array:
        """x [T, I] -> [T, O] in `preferred_element_type` (default x's dtype).

        `live` (the rows before the bucket's padding, as `layers.project` passes it) is taken
        for the packed projections' signature; this jnp path computes every row, as XLA's dot
        does for a float `nnx.Linear`.
        """
        del live
        out_dtype = self.preferred_element_type or x.dtype
        column = self.sharding == COLUMN
        local = functools.partial(_product, layout=self.layout, reduce=not column)
        specs = (P(None, None if column else TP_AXIS), P(*blocks_sharding(self.sharding, 2)))
        args = (x, self.kernel[...])
        if self.qtype is None:  # this layer's type index, the same on every device
            specs, args = (*specs, P()), (*args, self.kernel_qtype[...])
        y = jax.shard_map(local, mesh=self.mesh, in_specs=specs,
                          out_specs=P(None, TP_AXIS) if column else P())(*args)
        y = y.astype(out_dtype)  # then the bias, in the result's dtype as nnx.Linear adds it
        return y if self.bias is None else y + self.bias[...].astype(out_dtype)


def gguf_linear(linear: nnx.Linear, qtype: QTypes) -> GGUFLinear:
    """The GGUF counterpart of `linear` (its shape, sharding, bias and result dtype) with
    zero blocks of `qtype` (a mix: in its slots), for a model whose weights are then filled
    from a file."""
    meta = linear.kernel.get_metadata()
    rows = jnp.zeros((linear.out_features, row_bytes(linear.in_features, qtype)), jnp.uint8)
    return GGUFLinear(rows, qtype, sharding=tuple(meta["out_sharding"]), mesh=meta["mesh"],
                      bias=None if linear.bias is None else linear.bias[...],
                      preferred_element_type=linear.preferred_element_type)


def _product(x: jax.Array, blocks: jax.Array, *which: jax.Array, layout: SlotLayout,
             reduce: bool) -> jax.Array:
    """One device's x [T, I/tp or I] @ its blocks' rows [O or O/tp, I/tp or I].T -> f32[T, .],
    summed over tp for a row-parallel weight (`reduce`); `which`: a mix's type index."""
    w = dequantize_slots(blocks, which[0] if which else None, layout).astype(x.dtype)
    y = jnp.einsum("ti,oi->to", x, w, preferred_element_type=jnp.float32)
    return jax.lax.psum(y, TP_AXIS) if reduce else y


def gguf_embedder(embedder: Embedder, qtype: Q | int | str) -> GGUFEmbedder:
    """The GGUF counterpart of `embedder` with zero blocks of `qtype` (filled from a file)."""
    V, D = embedder.embedding.shape
    return GGUFEmbedder(jnp.zeros((V, row_bytes(D, qtype)), jnp.uint8), qtype,
                        mesh=embedder.mesh, dtype=embedder.embedding.dtype)


class GGUFEmbedder(nnx.Module):
    """The token embedding [V', D] held as GGUF blocks u8[V', row_bytes], vocab-parallel like
    `layers.Embedder`; with tied weights also the output projection."""

    def __init__(self, blocks: jax.Array, qtype: Q | int | str, *, mesh: Mesh,
                 dtype: jnp.dtype) -> None:
        """Hold `blocks` (u8[V', row_bytes], V' a multiple of tp, the padding rows zero) of
        GGUF type `qtype`, split over the vocabulary; embeddings come out in `dtype`."""
        fmt = block_format(qtype)
        self.qtype, self.dtype, self.mesh = fmt.name, jnp.dtype(dtype), mesh
        self.hidden_size = blocks.shape[-1] // fmt.block_bytes * fmt.block_size
        self.embedding = nnx.Param(blocks, sharding_names=ROW, mesh=mesh)

    def encode(self, ids: jax.Array) -> jax.Array:
        """Token ids i32[T] -> embeddings [T, D] in the model's dtype.

        As `Embedder.encode` (`layers.vocab_parallel_rows`), dequantizing only the rows of
        blocks its ids pick.
        """
        return vocab_parallel_rows(self.mesh, ids, lambda rows, blocks: dequantize(
            jnp.take(blocks, rows, axis=0), self.qtype).astype(self.dtype), self.embedding[...])

    def decode(self, hidden: jax.Array) -> jax.Array:
        """Hidden states [R, D] -> f32[R, V'] logits against the embedding (tied head), split
        over the vocabulary like the blocks."""

        def local(hidden: jax.Array, blocks: jax.Array) -> jax.Array:
            table = dequantize(blocks, self.qtype).astype(self.dtype)  # [V'/tp, D]
            return jnp.einsum("rd,vd->rv", hidden, table, preferred_element_type=jnp.float32)

        return jax.shard_map(local, mesh=self.mesh, in_specs=(P(), P(TP_AXIS, None)),
                             out_specs=P(None, TP_AXIS))(hidden, self.embedding[...])


EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def _rows_spec(kernel: P) -> P:
    """The split of blocks [E, O, row_bytes] holding expert kernels [E, I, O] split `kernel`."""
    return P(kernel[0], kernel[2], kernel[1])


class GGUFExperts(nnx.Module):
    """`moe.Experts` held as GGUF blocks: `gate_proj`, `up_proj` u8[E, F, row_bytes(D)] and
    `down_proj` u8[E, D, row_bytes(F)] (each expert's [out, in] rows, as the file's stacked
    `*_exps` tensors hold them), each of its own type; one whose layers mix types (llama.cpp's
    Q4_K_M `ffn_down_exps`) in slots, with `<name>_qtype` each layer's type as `GGUFLinear`'s.

    The grouped matmul reads float matrices, so each device dequantizes its blocks inside the
    step right before it (`matrices`); split as the float experts are (expert parallel: whole
    experts; else F, down's at block boundaries).
    """

    def __init__(self, blocks: tuple[jax.Array, jax.Array, jax.Array],
                 qtypes: tuple[QTypes, QTypes, QTypes], *, gate_up_spec: P, down_spec: P,
                 mesh: Mesh) -> None:
        """Hold gate, up, down `blocks` of `qtypes` (each a type, or a mix's types), split
        like float experts of `gate_up_spec` / `down_spec` ([E, I, O] kernels' specs); a
        mix's type indices are zeros, filled from a file.

        Raises:
            ValueError: an unsupported type, or a down projection split over tp (not expert
                parallel) whose F/tp is not whole blocks.
        """
        self.layouts = tuple(slot_layout(_types(t)) for t in qtypes)
        self.gate_up_spec, self.down_spec = gate_up_spec, down_spec
        down, F = self.layouts[2], blocks[0].shape[-2]
        tp = tp_size(mesh)
        if down_spec[1] is not None and (F // tp) % down.values:
            raise ValueError(
                f"{'/'.join(down.qtypes)} expert down projections of {F} input features cannot "
                f"be split over tensor_parallel_size={tp} at {down.values}-value block "
                "boundaries: use enable_expert_parallel, another tensor_parallel_size, or "
                "quantization=None")
        specs = (gate_up_spec, gate_up_spec, down_spec)
        for name, rows, spec, layout in zip(EXPERT_WEIGHTS, blocks, specs, self.layouts,
                                            strict=True):
            setattr(self, name, nnx.Param(rows, sharding_names=tuple(_rows_spec(spec)),
                                          mesh=mesh))
            if len(layout.qtypes) > 1:  # replicated, as `GGUFLinear`'s
                setattr(self, qtype_name(name), nnx.Param(jnp.zeros(rows.shape[:-3], jnp.int32)))

    def operands(self) -> tuple[tuple[jax.Array, P], ...]:
        """The blocks of gate, up and down, each with its split over "tp", and after a mix's
        blocks its layer's type index (replicated)."""
        specs = (self.gate_up_spec, self.gate_up_spec, self.down_spec)
        out = []
        for name, spec, layout in zip(EXPERT_WEIGHTS, specs, self.layouts, strict=True):
            out.append((getattr(self, name)[...], _rows_spec(spec)))
            if len(layout.qtypes) > 1:
                out.append((getattr(self, qtype_name(name))[...], P()))
        return tuple(out)

    def matrices(self, *local: jax.Array, dtype: jnp.dtype
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One device's gate, up [E_local, D, F_local] and down [E_local, F_local, D] in
        `dtype`, dequantized from its blocks of `operands()`."""
        arrays, out = iter(local), []
        for layout in self.layouts:
            rows = next(arrays)
            which = next(arrays) if len(layout.qtypes) > 1 else None
            out.append(jnp.swapaxes(dequantize_slots(rows, which, layout), -1, -2).astype(dtype))
        gate, up, down = out
        return gate, up, down


def gguf_experts(experts: nnx.Module, qtypes: tuple[QTypes, QTypes, QTypes]) -> GGUFExperts:
    """The GGUF counterpart of `moe.Experts` `experts` with zero blocks of `qtypes` (gate,
    up, down; each a type or a mix's types), filled from a file."""
    E, D, F = experts.gate_proj.shape
    mesh = experts.gate_proj.get_metadata()["mesh"]
    shapes = ((E, F, row_bytes(D, qtypes[0])), (E, F, row_bytes(D, qtypes[1])),
              (E, D, row_bytes(F, qtypes[2])))
    return GGUFExperts(tuple(jnp.zeros(s, jnp.uint8) for s in shapes), qtypes,
                       gate_up_spec=experts.gate_up_spec, down_spec=experts.down_spec,
                       mesh=mesh)


class BlockReader(Protocol):
    """Reads the blocks of one weight from a GGUF file, laid out for the mesh, by module path
    (with a mix's `qtype_name` type indices) (jaxengine/loading/gguf_weights.py)."""

    def __call__(self, path: Path, name: str, shape: tuple[int, ...], layout: TPLayout, *,
                 lacks: Callable[[int], bool], on_tensor: Callable[[], object]
                 ) -> dict[Path, np.ndarray]: ...


@dataclasses.dataclass(frozen=True, slots=True)
class GGUFFormat:
    """`WeightFormat` "gguf" (jaxengine/model/quant/formats.py): each matrix a GGUF file holds
    quantized is served from its blocks, each in its own type (a projection whose layers mix
    types: in `GGUFLinear`'s slots); the rest stay float modules.

    Without `types` (no file: `quantization="gguf"` for anything but a GGUF load) it refuses
    to build, so a model is never silently float or made of zero blocks.
    """

    # weight path (scanned layout) -> its GGUF types, in the order of the first layer of each
    # (one for most weights)
    types: Mapping[Path, tuple[Q, ...]] | None = None
    read: BlockReader | None = None  # the file's blocks of a weight
    name: str = "gguf"

    def _type(self, path: Path) -> tuple[Q, ...] | None:
        if self.types is None:
            raise ValueError("quantization='gguf' serves the blocks of a .gguf file; load one "
                             "with load_model(path_to_gguf, quantization='gguf'), or choose "
                             "another quantization for other checkpoints")
        return self.types.get(path)

    def linear(self, linear: nnx.Linear, path: Path) -> nnx.Module:
        qtypes = self._type((*path, "kernel"))
        return linear if qtypes is None else gguf_linear(linear, qtypes)

    def embedder(self, embedder: Embedder, path: Path) -> nnx.Module:
        qtypes = self._type((*path, "embedding"))  # one: the embedding has no layers
        return embedder if qtypes is None else gguf_embedder(embedder, *qtypes)

    def experts(self, experts: nnx.Module, path: Path) -> nnx.Module:
        qtypes = [self._type((*path, name)) for name in EXPERT_WEIGHTS]
        if all(t is None for t in qtypes):
            return experts
        if any(t is None for t in qtypes):
            found = ", ".join("/".join(q.name for q in t) if t else "float" for t in qtypes)
            raise ValueError(f"experts {'.'.join(map(str, path))}: quantization='gguf' holds "
                             "gate, up and down all quantized or all float, but the file "
                             f"has {found}")
        return gguf_experts(experts, tuple(qtypes))

    def read_host(self, path: Path, name: str, shape: tuple[int, ...], layout: TPLayout, *,
                  lacks: Callable[[int], bool], on_tensor: Callable[[], object]
                  ) -> dict[Path, np.ndarray] | None:
        """The blocks of quantized weight `path` (float `shape`) as the file holds them, laid
        out for the mesh (a mix's type indices beside them); None for a weight the file holds
        as floats."""
        if path not in (self.types or {}) or self.read is None:
            return None
        return self.read(path, name, shape, layout, lacks=lacks, on_tensor=on_tensor)

    def host_weights(self, path: Path, host: np.ndarray, like: jax.ShapeDtypeStruct
                     ) -> dict[Path, np.ndarray]:
        """Never called: blocks are read from the file (`read_host`), not made from floats."""
        raise RuntimeError(f"{'.'.join(map(str, path))}: GGUF blocks come from the file")
