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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine_kernels.cpu import native


def panel_width() -> int:
    """Columns per panel of this machine's build (raises `NativeBuildError` without one)."""
    return native.matmul_target()[1]


def pack(w: jax.Array | np.ndarray) -> jax.Array:
    """w f32[K, N] -> panels f32[ceil(N/W), K, W] (zero columns past N)."""
    width = panel_width()
    K, N = w.shape
    panels = -(-N // width)
    w = jnp.pad(jnp.asarray(w, jnp.float32), ((0, 0), (0, panels * width - N)))
    return w.reshape(K, panels, width).transpose(1, 0, 2)


def pack_swiglu(gate: jax.Array | np.ndarray, up: jax.Array | np.ndarray) -> jax.Array:
    """gate, up f32[K, F] -> panels f32[2 * ceil(F/W), K, W]: gate's panel p, then up's."""
    pg, pu = pack(gate), pack(up)
    return jnp.stack([pg, pu], axis=1).reshape(-1, *pg.shape[1:])


def packed_matmul(x: jax.Array, panels: jax.Array, n: int,
                  live: jax.Array | int | None = None) -> jax.Array:
    """x f32[..., K] @ w -> f32[..., n], w given as `pack(w)`'s panels f32[ceil(n/W), K, W].

    `live` (i32[], default: all) counts the rows of x (its leading axes flattened) that are
    computed; the rows past it come out zero, at no cost (an engine step's padding).

    Under jax.vmap the kernel runs once per batch element. There is no derivative rule: this
    is for inference (the model's XLA layout serves training).
    """
    return _call(native.matmul_target()[0], x, panels, n, 1, live)


def packed_swiglu(x: jax.Array, panels: jax.Array, n: int,
                  live: jax.Array | int | None = None) -> jax.Array:
    """silu(x @ gate) * (x @ up) -> f32[..., n] for x f32[..., K], gate and up [K, n] given as
    `pack_swiglu`'s panels; `live` and vmap as `packed_matmul`'s. silu's exponential is the
    kernel's own (within 2 ulp of e^x), so outputs agree with XLA's to a few ulp."""
    return _call(native.swiglu_target(), x, panels, n, 2, live)


def _call(target: str, x: jax.Array, panels: jax.Array, n: int, parts: int,
          live: jax.Array | int | None) -> jax.Array:
    """The custom call over panels of `parts` weight panels per output panel."""
    width = panel_width()
    K = x.shape[-1]
    if panels.ndim != 3 or panels.shape[1] != K or panels.shape[2] != width or \
            panels.shape[0] != parts * -(-n // width):
        kernels = f"a [{K}, {n}] kernel" if parts == 1 else f"gate and up [{K}, {n}] kernels"
        raise ValueError(f"panels {panels.shape} do not pack {kernels} for a panel width of "
                         f"{width}")
    if x.dtype != jnp.float32 or panels.dtype != jnp.float32:
        raise ValueError(f"packed_matmul takes float32, got {x.dtype} and {panels.dtype}")
    lead = x.shape[:-1]
    rows = x.reshape(-1, K)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    live = rows.shape[0] if live is None else live
    return call(rows, panels, jnp.asarray(live, jnp.int32)).reshape(*lead, n)
