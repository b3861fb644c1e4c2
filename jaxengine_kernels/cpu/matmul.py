"""A float32 matmul on the CPU over weights packed in column panels (``packed_matmul.cc``).

``pack(w)`` lays a kernel w [K, N] out as panels [ceil(N/W), K, W]: panel p holds columns
p*W ... p*W+W-1 row by row, zeros past N, so that the native loop reads each panel as one
contiguous stream; W is the width the library was built with (64 floats with AVX-512, 24 with
AVX2, 32 with AVX, 16 otherwise). ``packed_matmul(x, panels, n)`` is then ``x @ w`` with w's
N = n columns.
The model packs its projections this way on a one-device CPU mesh in float32
(jaxengine/model/packing.py); everywhere else they stay XLA dots.

A SwiGLU MLP's gate and up kernels pack together (`pack_swiglu`): their panels interleaved, so
that ``packed_swiglu(x, panels, n)`` = silu(x @ gate) * (x @ up) comes out of one call, each
output panel's two products finished in registers' reach instead of written as [M, 2F] and
read back by XLA.

Weight-only int8 goes the same way (`pack_int8`, `packed_matmul_int8`, `pack_swiglu_int8`,
`packed_swiglu_int8`): int8 panels [ceil(N/W), K, W] of a quarter of the bytes with float32
scales for each group of G inputs of each column (`jaxengine.model.quant.channel`'s groups),
packed as panels [ceil(N/W), K/G, W] beside them; the kernel widens the values to float32 and
multiplies them by their scales, so the product is x @ (values * scale) in float32 arithmetic.

Every product is differentiable (``jax.custom_vjp``): the forward is the kernel, the backward
the VJP of the same product written in XLA operations (`_xla`: the kernels read back out of
the panels, SwiGLU's gate and up recomputed), run by XLA. Float32 panels get dx = dy @ w.T and
d(panels) = pack(x.T @ dy), the panels being the parameters a caller holds (zeros in the
padding columns); int8 panels get dx and the cotangent of their scales' panels, and none for
the integer values (a quantized model's trainable parameters are its float ones). Rows past
`live` get none.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine_kernels.cpu import native


def panel_width() -> int:
    """Columns per panel of this machine's build (raises `NativeBuildError` without one)."""
    return native.matmul_target()[1]


def pack(*w: jax.Array | np.ndarray) -> jax.Array:
    """w f32[K, N] -> panels f32[ceil(N/W), K, W] (zero columns past N); several kernels of
    one input, f32[K, N_i] each, pack side by side as one of N = sum N_i columns."""
    return _side_by_side(tuple(jnp.asarray(part, jnp.float32) for part in w))


def pack_transposed(table: jax.Array | np.ndarray) -> jax.Array:
    """`pack(table.T)` for a table f32[N, K] (a tied embedding as its LM head's kernel), the
    transpose made in the same pass as the panels."""
    return _transposed(jnp.asarray(table, jnp.float32))


def pack_swiglu(gate: jax.Array | np.ndarray, up: jax.Array | np.ndarray) -> jax.Array:
    """gate, up f32[K, F] -> panels f32[2 * ceil(F/W), K, W]: gate's panel p, then up's."""
    return _swiglu(jnp.asarray(gate, jnp.float32), jnp.asarray(up, jnp.float32))


def pack_int8(values: jax.Array | np.ndarray, scale: jax.Array | np.ndarray
              ) -> tuple[jax.Array, jax.Array]:
    """values i8[K, N] with scales f32[K/G, N] (one per G inputs of each column) -> (panels
    i8[ceil(N/W), K, W], scale panels f32[ceil(N/W), K/G, W]), zero columns past N."""
    values, scale = jnp.asarray(values), jnp.asarray(scale)
    if values.dtype != jnp.int8:
        raise ValueError(f"pack_int8 takes int8 values, got {values.dtype}")
    K, N = values.shape
    if scale.dtype != jnp.float32 or scale.ndim != 2 or scale.shape[1] != N or \
            scale.shape[0] < 1 or K % scale.shape[0]:
        raise ValueError(f"int8 values [{K}, {N}] take float32 scales [K/G, {N}] for a group "
                         f"size G dividing {K}, got {scale.dtype}{list(scale.shape)}")
    return _panels(values), _panels(scale)


def pack_swiglu_int8(gate: jax.Array | np.ndarray, gate_scale: jax.Array | np.ndarray,
                     up: jax.Array | np.ndarray, up_scale: jax.Array | np.ndarray
                     ) -> tuple[jax.Array, jax.Array]:
    """gate, up i8[K, F] with their scales f32[K/G, F] -> (panels i8[2 * ceil(F/W), K, W],
    scale panels f32[2 * ceil(F/W), K/G, W]): gate's panel p, then up's."""
    gate, gate_scale = pack_int8(gate, gate_scale)
    up, up_scale = pack_int8(up, up_scale)
    return _interleave(gate, up), _interleave(gate_scale, up_scale)


def unpack(panels: jax.Array, n: int) -> jax.Array:
    """`pack`'s inverse: panels [ceil(n/W), K, W] (any dtype) -> the kernel [K, n]."""
    P, K, W = panels.shape
    return panels.transpose(1, 0, 2).reshape(K, P * W)[:, :n]


# Jitted whole: packing a model runs these once per layer, each one program (one pass over the
# weights, one dispatch) per shape, where eager concatenate/pad/reshape/transpose/stack would
# each copy the weights and compile one program per operation and shape.
@jax.jit
def _side_by_side(w: tuple[jax.Array, ...]) -> jax.Array:
    """Kernels [K, N_i] -> the panels of [K, sum N_i]."""
    return _panels(w[0] if len(w) == 1 else jnp.concatenate(w, axis=1))


@jax.jit
def _transposed(table: jax.Array) -> jax.Array:
    """A table [N, K] -> the panels of its transpose [K, N]."""
    return _panels(table.T)


@jax.jit
def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """gate, up [K, F] -> their panels interleaved, [2 * ceil(F/W), K, W]."""
    return _interleave(_panels(gate), _panels(up))


@jax.jit
def _panels(w: jax.Array) -> jax.Array:
    """w [K, N] -> [ceil(N/W), K, W] in w's dtype, zeros past N."""
    width = panel_width()
    K, N = w.shape
    panels = -(-N // width)
    w = jnp.pad(w, ((0, 0), (0, panels * width - N)))
    return w.reshape(K, panels, width).transpose(1, 0, 2)


@jax.jit
def _interleave(gate: jax.Array, up: jax.Array) -> jax.Array:
    """Two kernels' panels [P, K, W] -> [2P, K, W]: gate's panel p, then up's."""
    return jnp.stack([gate, up], axis=1).reshape(-1, *gate.shape[1:])


def packed_matmul(x: jax.Array, panels: jax.Array, n: int,
                  live: jax.Array | int | None = None) -> jax.Array:
    """x f32[..., K] @ w -> f32[..., n], w given as `pack(w)`'s panels f32[ceil(n/W), K, W].

    `live` (i32[], default: all) counts the rows of x (its leading axes flattened) that are
    computed; the rows past it come out zero, at no cost (an engine step's padding).

    Under jax.vmap the kernel runs once per batch element. Reverse mode gives dx and the
    panels' cotangent in their layout (module docstring).
    """
    return _call(native.matmul_target()[0], x, panels, n, 1, live)


def packed_swiglu(x: jax.Array, panels: jax.Array, n: int,
                  live: jax.Array | int | None = None) -> jax.Array:
    """silu(x @ gate) * (x @ up) -> f32[..., n] for x f32[..., K], gate and up [K, n] given as
    `pack_swiglu`'s panels; `live` and vmap as `packed_matmul`'s. silu's exponential is the
    kernel's own (within 2 ulp of e^x), so outputs agree with XLA's to a few ulp."""
    return _call(native.swiglu_target(), x, panels, n, 2, live)


def packed_matmul_int8(x: jax.Array, panels: jax.Array, scale: jax.Array, n: int,
                       live: jax.Array | int | None = None) -> jax.Array:
    """x f32[..., K] @ (values * scale) -> f32[..., n], values i8[K, n] and their scales
    f32[K/G, n] given as `pack_int8`'s panels i8[ceil(n/W), K, W] and scale panels
    f32[ceil(n/W), K/G, W]; `live` and vmap as `packed_matmul`'s."""
    return _call(native.int8_target(swiglu=False), x, panels, n, 1, live, scale)


def packed_swiglu_int8(x: jax.Array, panels: jax.Array, scale: jax.Array, n: int,
                       live: jax.Array | int | None = None) -> jax.Array:
    """silu(x @ (gate * gate_scale)) * (x @ (up * up_scale)) -> f32[..., n] for gate and up
    i8[K, n] with scales f32[K/G, n] given as `pack_swiglu_int8`'s panels and scale panels;
    `live` and vmap as `packed_matmul`'s."""
    return _call(native.int8_target(swiglu=True), x, panels, n, 2, live, scale)


def _call(target: str, x: jax.Array, panels: jax.Array, n: int, parts: int,
          live: jax.Array | int | None, scale: jax.Array | None = None) -> jax.Array:
    """The custom call over panels of `parts` weight panels per output panel (float32, or int8
    with `scale` panels f32[panels, K/G, W])."""
    width = panel_width()
    K = x.shape[-1]
    if panels.ndim != 3 or panels.shape[1] != K or panels.shape[2] != width or \
            panels.shape[0] != parts * -(-n // width):
        kernels = f"a [{K}, {n}] kernel" if parts == 1 else f"gate and up [{K}, {n}] kernels"
        raise ValueError(f"panels {panels.shape} do not pack {kernels} for a panel width of "
                         f"{width}")
    weights = jnp.float32 if scale is None else jnp.int8
    if x.dtype != jnp.float32 or panels.dtype != weights:
        raise ValueError(f"packed_matmul takes float32 x and {jnp.dtype(weights)} panels, got "
                         f"{x.dtype} and {panels.dtype}")
    if scale is not None and (scale.dtype != jnp.float32 or scale.ndim != 3 or
                              scale.shape[::2] != panels.shape[::2] or scale.shape[1] < 1 or
                              K % scale.shape[1]):
        raise ValueError(f"the int8 panels' scales must be float32[{panels.shape[0]}, K/G, "
                         f"{width}] for a group size G dividing K={K}, got "
                         f"{scale.dtype}{list(scale.shape)}")
    lead = x.shape[:-1]
    rows = x.reshape(-1, K)
    live = jnp.asarray(rows.shape[0] if live is None else live, jnp.int32)
    return _product(target, n, parts, rows, panels, scale, live).reshape(*lead, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _product(target: str, n: int, parts: int, rows: jax.Array, panels: jax.Array,
             scale: jax.Array | None, live: jax.Array) -> jax.Array:
    """The kernel's f32[M, n] for rows f32[M, K]; its backward is `_xla`'s VJP."""
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    operands = (panels,) if scale is None else (panels, scale)
    return call(rows, *operands, live)


def _product_fwd(target, n, parts, rows, panels, scale, live):
    # The output is the custom_vjp's own: a second derivative takes this rule again.
    return _product(target, n, parts, rows, panels, scale, live), (rows, panels, scale, live)


def _product_bwd(target, n, parts, residuals, dy):
    """dx, and d(panels) in the panel layout (zeros in the padding columns) for float32 panels,
    d(scale) for int8 ones, whose integer values get none."""
    del target
    rows, panels, scale, live = residuals
    if scale is None:
        _, vjp = jax.vjp(lambda x, p: _xla(x, p, None, live, n, parts), rows, panels)
        dx, d_panels = vjp(dy)
        return dx, d_panels, None, None
    _, vjp = jax.vjp(lambda x, s: _xla(x, panels, s, live, n, parts), rows, scale)
    dx, d_scale = vjp(dy)
    return dx, None, d_scale, None


_product.defvjp(_product_fwd, _product_bwd)


def _xla(rows: jax.Array, panels: jax.Array, scale: jax.Array | None, live: jax.Array, n: int,
         parts: int) -> jax.Array:
    """The kernel's product f32[M, n] in XLA operations, the maths its backward differentiates:
    each part's kernel [K, n] read back out of the panels (and scaled, int8's), x @ w, SwiGLU's
    silu(gate) * up for two parts, the rows past `live` zero."""
    per_part = panels.reshape(-1, parts, *panels.shape[1:])  # [P, parts, K, W]
    ys = []
    for i in range(parts):
        w = unpack(per_part[:, i], n).astype(jnp.float32)  # [K, n]
        if scale is not None:
            s = unpack(scale.reshape(-1, parts, *scale.shape[1:])[:, i], n)  # [K/G, n]
            w = (w.reshape(s.shape[0], -1, n) * s[:, None, :]).reshape(w.shape)
        ys.append(jnp.dot(rows, w, precision=jax.lax.Precision.HIGHEST))
    y = ys[0] if parts == 1 else jax.nn.silu(ys[0]) * ys[1]
    return jnp.where(jnp.arange(rows.shape[0])[:, None] < live, y, 0.0)
