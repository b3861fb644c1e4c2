"""GGUF's quantized blocks dequantized in jnp: bytes as the file stores them -> float32.

A quantized GGUF matrix [out, in] is stored row by row, each row the blocks of one output row
along the input axis: u8[out, in / block_size * block_bytes]. `dequantize` turns such rows
(any leading axes: a stacked layer axis, experts) into f32[..., out, in] with vectorised bit
operations on the bytes, f16 scales read by `lax.bitcast_convert_type`, so it runs inside a
jitted matmul on any backend. The arithmetic is `gguf.quants`' own, operation for operation
(the products of a scale and a quant are exact in float32 but for Q6_K's, done in the same
order), so the values equal the `gguf` package's bit for bit; a block of zero bytes
dequantizes to zeros in every type (vocabulary padding rows).
Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32-element blocks) and the k-quants Q4_K, Q5_K, Q6_K
(256).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import gguf
import jax
import jax.numpy as jnp
import numpy as np

Q = gguf.GGMLQuantizationType


def _f16(b: jax.Array) -> jax.Array:
    """u8[..., 2] little-endian float16 bytes -> f32[...]."""
    u = b[..., 0].astype(jnp.uint16) | (b[..., 1].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(u, jnp.float16).astype(jnp.float32)


def _nibbles(qs: jax.Array, groups: int) -> jax.Array:
    """u8[..., groups * n] -> u8[..., groups * 2n]: within each group of n bytes, the n low
    nibbles, then the n high ones (the order of every 4-bit GGUF type)."""
    g = qs.reshape(*qs.shape[:-1], groups, 1, -1) >> jnp.array([0, 4], jnp.uint8)[:, None]
    return (g & 0x0F).reshape(*qs.shape[:-1], -1)


def _q4_0(b: jax.Array) -> jax.Array:  # [..., 18]: f16 d, 16 bytes of 32 nibbles
    q = _nibbles(b[..., 2:], 1).astype(jnp.int32) - 8
    return _f16(b[..., 0:2])[..., None] * q.astype(jnp.float32)


def _q4_1(b: jax.Array) -> jax.Array:  # [..., 20]: f16 d, f16 m, 16 bytes of 32 nibbles
    q = _nibbles(b[..., 4:], 1).astype(jnp.float32)
    return _f16(b[..., 0:2])[..., None] * q + _f16(b[..., 2:4])[..., None]


def _bits32(b: jax.Array) -> jax.Array:
    """u8[..., 4], a little-endian uint32 -> u8[..., 32]: its bit i at i (0 or 1)."""
    bits = (b[..., :, None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
    return bits.reshape(*b.shape[:-1], 32)


def _q5_0(b: jax.Array) -> jax.Array:  # [..., 22]: f16 d, u32 high bits, 16 bytes of nibbles
    q = (_nibbles(b[..., 6:], 1) | (_bits32(b[..., 2:6]) << 4)).astype(jnp.int32) - 16
    return _f16(b[..., 0:2])[..., None] * q.astype(jnp.float32)


def _q5_1(b: jax.Array) -> jax.Array:  # [..., 24]: f16 d, f16 m, u32 high bits, 16 bytes
    q = (_nibbles(b[..., 8:], 1) | (_bits32(b[..., 4:8]) << 4)).astype(jnp.float32)
    return _f16(b[..., 0:2])[..., None] * q + _f16(b[..., 2:4])[..., None]


def _q8_0(b: jax.Array) -> jax.Array:  # [..., 34]: f16 d, 32 int8
    q = jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32)
    return q * _f16(b[..., 0:2])[..., None]


def _k_scale_min(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> (scales, mins) f32[..., 8]."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(jnp.float32), mn.astype(jnp.float32)


def _k_affine(b: jax.Array, q: jax.Array) -> jax.Array:
    """Q4_K/Q5_K: f16 d and dmin, 12 bytes of scales; quants q [..., 8, 32] -> f32[..., 256]."""
    sc, mn = _k_scale_min(b[..., 4:16])
    d = (_f16(b[..., 0:2])[..., None] * sc)[..., None]  # [..., 8, 1]
    dm = (_f16(b[..., 2:4])[..., None] * mn)[..., None]
    return (d * q.astype(jnp.float32) - dm).reshape(*b.shape[:-1], 256)


def _q4_k(b: jax.Array) -> jax.Array:  # [..., 144]: d, dmin, scales[12], 128 bytes of nibbles
    return _k_affine(b, _nibbles(b[..., 16:], 4).reshape(*b.shape[:-1], 8, 32))


def _q5_k(b: jax.Array) -> jax.Array:  # [..., 176]: d, dmin, scales[12], qh[32], qs[128]
    low = _nibbles(b[..., 48:], 4).reshape(*b.shape[:-1], 8, 32)
    bits = jnp.arange(8, dtype=jnp.uint8)[:, None]
    high = (b[..., None, 16:48] >> bits) & 1  # [..., 8, 32]: bit j of byte i is value 32j + i
    return _k_affine(b, low | (high << 4))


def _q6_k(b: jax.Array) -> jax.Array:  # [..., 210]: ql[128], qh[64], int8 scales[16], f16 d
    lead = b.shape[:-1]
    low = _nibbles(b[..., :128], 2).reshape(*lead, 8, 32)
    shifts = jnp.array([0, 2, 4, 6], jnp.uint8)[:, None]
    high = ((b[..., 128:192].reshape(*lead, 2, 1, 32) >> shifts) & 3).reshape(*lead, 8, 32)
    q = ((low | (high << 4)).astype(jnp.int32) - 32).astype(jnp.float32)
    scales = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
    d = (_f16(b[..., 208:210])[..., None] * scales)[..., None]  # [..., 16, 1]
    return (d * q.reshape(*lead, 16, 16)).reshape(*lead, 256)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BlockFormat:
    """One GGUF quantization type: a block of `block_size` values in `block_bytes` bytes."""

    name: str  # GGUF's name of the type, e.g. "Q4_1"
    block_size: int  # values per block
    block_bytes: int  # bytes per block
    # u8[..., block_bytes] -> f32[..., block_size]
    dequantize_blocks: Callable[[jax.Array], jax.Array]


BLOCK_FORMATS: dict[Q, BlockFormat] = {
    t: BlockFormat(name=t.name, block_size=gguf.GGML_QUANT_SIZES[t][0],
                   block_bytes=gguf.GGML_QUANT_SIZES[t][1], dequantize_blocks=f)
    for t, f in ((Q.Q4_0, _q4_0), (Q.Q4_1, _q4_1), (Q.Q5_0, _q5_0), (Q.Q5_1, _q5_1),
                 (Q.Q8_0, _q8_0), (Q.Q4_K, _q4_k), (Q.Q5_K, _q5_k), (Q.Q6_K, _q6_k))}
SUPPORTED = ", ".join(f.name for f in BLOCK_FORMATS.values())


def block_format(qtype: Q | int | str) -> BlockFormat:
    """The format of a GGUF type (enum, its value or its name).

    Raises:
        ValueError: a type without a jnp dequantizer here; the message lists those there are.
    """
    try:
        t = Q[qtype] if isinstance(qtype, str) else Q(qtype)
    except (KeyError, ValueError):
        raise ValueError(f"unknown GGUF quantization type {qtype!r}; supported: "
                         f"{SUPPORTED}") from None
    if t not in BLOCK_FORMATS:
        raise ValueError(f"GGUF quantization type {t.name} is not served from its blocks; "
                         f"supported: {SUPPORTED}")
    return BLOCK_FORMATS[t]


def dequantize(rows: jax.Array, qtype: Q | int | str) -> jax.Array:
    """GGUF rows of blocks -> float32 values.

    Args:
        rows: u8[..., row_bytes], each row whole blocks of `qtype`.
        qtype: the GGUF quantization type.
    Returns:
        f32[..., row_bytes / block_bytes * block_size].
    """
    fmt = block_format(qtype)
    *lead, row_bytes = rows.shape
    if row_bytes % fmt.block_bytes:
        raise ValueError(f"{fmt.name} rows of {row_bytes} bytes are not whole blocks of "
                         f"{fmt.block_bytes} bytes")
    # blocks keep their row's axes, so a row split over devices at block boundaries stays split
    values = fmt.dequantize_blocks(rows.reshape(*lead, -1, fmt.block_bytes))
    return values.reshape(*lead, row_bytes // fmt.block_bytes * fmt.block_size)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SlotLayout:
    """Rows of one weight whose GGUF type differs from layer to layer (llama.cpp's "_M"
    mixes: some layers' `ffn_down` and `attn_v` Q6_K, the rest Q4_K), held as one array.

    Each row is a run of slots of `values` inputs (whole blocks of every type: the least
    common multiple of their block sizes), each `slot_bytes` long (the widest type's bytes for
    those values); a layer's blocks fill the start of each slot and zero bytes the rest, so a
    row split at slot boundaries (tensor parallel) is whole blocks of whichever type. Of one
    type, a slot is a block: the rows exactly as the file stores them.
    """

    qtypes: tuple[str, ...]  # the types' names, in the order a layer's index names them
    values: int  # inputs per slot
    slot_bytes: int  # bytes per slot


def slot_layout(qtypes: Sequence[Q | int | str]) -> SlotLayout:
    """The slots holding blocks of any of `qtypes` (enums, values or names; one or more).

    Raises:
        ValueError: a type without a dequantizer here.
    """
    fmts = [block_format(t) for t in qtypes]
    values = math.lcm(*(f.block_size for f in fmts))
    return SlotLayout(qtypes=tuple(f.name for f in fmts), values=values,
                      slot_bytes=max(values // f.block_size * f.block_bytes for f in fmts))


def _used(layout: SlotLayout, qtype: Q | int | str) -> int:
    """The bytes of `qtype`'s blocks at the start of each slot of `layout`."""
    fmt = block_format(qtype)
    return layout.values // fmt.block_size * fmt.block_bytes


def to_slots(rows: np.ndarray, qtype: Q | int | str, layout: SlotLayout) -> np.ndarray:
    """Rows u8[..., row_bytes] of `qtype` (one of `layout.qtypes`), as the file stores them ->
    u8[..., slots * slot_bytes] in `layout`'s slots (host arrays)."""
    used = _used(layout, qtype)
    if used == layout.slot_bytes:  # the widest type (or the only one): its rows as they are
        return rows
    *lead, row_bytes = rows.shape
    out = np.zeros((*lead, row_bytes // used, layout.slot_bytes), np.uint8)
    out[..., :used] = rows.reshape(*lead, -1, used)
    return out.reshape(*lead, -1)


def dequantize_slots(rows: jax.Array, which: jax.Array | None, layout: SlotLayout
                     ) -> jax.Array:
    """Rows in `layout`'s slots -> float32 values, by the type `layout.qtypes[which]`.

    Args:
        rows: u8[..., slots * slot_bytes].
        which: i32[] the rows' type, an index into `layout.qtypes` (a traced value: one
            `lax.switch` over the types, so a scanned layer picks its own); None for a layout
            of one type.
    Returns:
        f32[..., slots * values].
    """
    if len(layout.qtypes) == 1:
        return dequantize(rows, layout.qtypes[0])
    *lead, row_bytes = rows.shape
    slots = rows.reshape(*lead, row_bytes // layout.slot_bytes, layout.slot_bytes)

    def branch(qtype: str) -> Callable[[jax.Array], jax.Array]:
        used = _used(layout, qtype)
        return lambda s: dequantize(s[..., :used].reshape(*lead, -1), qtype)

    return jax.lax.switch(which, [branch(t) for t in layout.qtypes], slots)
