"""A float32 matmul on the CPU over GGUF blocks as the file stores them (``block_matmul.cc``).

A GGUF weight of N output rows and K inputs is u8[N, K/32 * B]: row n holds output n's blocks
of 32 weights along K, B bytes each (Q4_1: f16 d, f16 m and 16 bytes of 4-bit q, 20 bytes;
Q8_0: f16 d and 32 int8 q, 34 bytes). ``block_matmul(x, blocks, "Q4_1")`` is then
``x @ dequantize(blocks).T`` with the blocks dequantized inside the kernel, never stored: a
decode step reads 0.625 bytes a weight (Q4_1) where float32 panels take 4. The outputs equal
the float32 product over ``gguf.quants.dequantize``'s weights to float32 rounding (the kernel
sums each output in kLanes partial sums; see the source).

``block_swiglu(x, gate, up, ...)`` gives silu(x @ gate.T) * (x @ up.T) in one call, the MLP's
hidden activations from two weights' blocks.

Both are differentiable in x (``jax.custom_vjp``): the forward is the kernel, the backward the
VJP of the same product in XLA operations over the weights `gguf_blocks.dequantize` unpacks
(the dequantizer of the model's jnp path; SwiGLU's gate and up recomputed), run by XLA. The
blocks are integers and get no cotangent: a GGUF model's trainable parameters are its float
ones (norms, embeddings kept in floats).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxengine_kernels.cpu import native
from jaxengine_kernels.gguf_blocks import dequantize

BLOCK_SIZE = 32  # weights per block of every type the kernel reads
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}  # bytes per block


def block_matmul(x: jax.Array, blocks: jax.Array, quant_type: str,
                 live: jax.Array | int | None = None) -> jax.Array:
    """x f32[..., K] @ dequantize(blocks).T -> f32[..., N] for blocks u8[N, K/32 * B] of
    `quant_type` ("Q4_1" or "Q8_0").

    `live` (i32[], default: all) counts the rows of x (its leading axes flattened) that are
    computed; the rows past it come out zero, at no cost (an engine step's padding). Under
    jax.vmap the kernel runs once per batch element. Reverse mode gives dx (module docstring).

    Raises:
      ValueError: another type, blocks that do not hold [N, K] weights, or x not float32.
    """
    return _call(quant_type, x, blocks, blocks, swiglu=False, live=live)


def block_swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, quant_type: str,
                 live: jax.Array | int | None = None) -> jax.Array:
    """silu(x @ dequantize(gate).T) * (x @ dequantize(up).T) -> f32[..., F] for gate and up
    u8[F, K/32 * B] of `quant_type`; `live`, vmap and errors as `block_matmul`'s. silu's
    exponential is the kernel's own (within 2 ulp of e^x)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {gate.shape} and up {up.shape} blocks must match")
    return _call(quant_type, x, gate, up, swiglu=True, live=live)


def q4_1_matmul(x: jax.Array, blocks: jax.Array,
                live: jax.Array | int | None = None) -> jax.Array:
    """`block_matmul` over Q4_1 blocks u8[N, K/32 * 20]."""
    return block_matmul(x, blocks, "Q4_1", live)


def q8_0_matmul(x: jax.Array, blocks: jax.Array,
                live: jax.Array | int | None = None) -> jax.Array:
    """`block_matmul` over Q8_0 blocks u8[N, K/32 * 34]."""
    return block_matmul(x, blocks, "Q8_0", live)


def _call(quant_type: str, x: jax.Array, gate: jax.Array, up: jax.Array, *, swiglu: bool,
          live: jax.Array | int | None) -> jax.Array:
    """The custom call of `quant_type` over gate's blocks (and up's with `swiglu`)."""
    target = native.block_target(quant_type, swiglu=swiglu)
    K = x.shape[-1]
    if K % BLOCK_SIZE or gate.ndim != 2 or gate.shape[1] != K // BLOCK_SIZE * \
            BLOCK_BYTES[quant_type]:
        raise ValueError(f"{quant_type} blocks {gate.shape} do not hold [N, {K}] weights (K a "
                         f"multiple of {BLOCK_SIZE}, {BLOCK_BYTES[quant_type]} bytes a block)")
    if x.dtype != jnp.float32 or gate.dtype != jnp.uint8:
        raise ValueError(f"block_matmul takes float32 x and uint8 blocks, got {x.dtype} and "
                         f"{gate.dtype}")
    lead, n = x.shape[:-1], gate.shape[0]
    rows = x.reshape(-1, K)
    live = jnp.asarray(rows.shape[0] if live is None else live, jnp.int32)
    return _product(target, quant_type, swiglu, rows, gate, up, live).reshape(*lead, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _product(target: str, quant_type: str, swiglu: bool, rows: jax.Array, gate: jax.Array,
             up: jax.Array, live: jax.Array) -> jax.Array:
    """The kernel's f32[M, N] for rows f32[M, K]; its backward is `_xla`'s VJP in x."""
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows.shape[0], gate.shape[0]),
                                                         jnp.float32), vmap_method="sequential")
    return call(rows, gate, up, live)


def _product_fwd(target, quant_type, swiglu, rows, gate, up, live):
    # The output is the custom_vjp's own: a second derivative takes this rule again.
    return _product(target, quant_type, swiglu, rows, gate, up, live), (rows, gate, up, live)


def _product_bwd(target, quant_type, swiglu, residuals, dy):
    """dx only: the blocks are integers (their cotangent is float0)."""
    del target
    rows, gate, up, live = residuals
    _, vjp = jax.vjp(lambda x: _xla(x, gate, up, live, quant_type, swiglu), rows)
    return (*vjp(dy), None, None, None)


_product.defvjp(_product_fwd, _product_bwd)


def _xla(rows: jax.Array, gate: jax.Array, up: jax.Array, live: jax.Array, quant_type: str,
         swiglu: bool) -> jax.Array:
    """The kernel's product f32[M, N] in XLA operations over `gguf_blocks.dequantize`'s
    weights, the maths its backward differentiates (SwiGLU's gate and up recomputed); the
    rows past `live` zero."""
    y = jnp.dot(rows, dequantize(gate, quant_type).T, precision=jax.lax.Precision.HIGHEST)
    if swiglu:
        y = jax.nn.silu(y) * jnp.dot(rows, dequantize(up, quant_type).T,
                                     precision=jax.lax.Precision.HIGHEST)
    return jnp.where(jnp.arange(rows.shape[0])[:, None] < live, y, 0.0)
