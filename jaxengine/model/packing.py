"""Projections packed for the native CPU matmul (pallas_kernels/cpu/matmul.py).

On the CPU a decode step reads every projection's weights from memory for a few rows; packed in
contiguous column panels, the same weights stream faster through the native loop than a [K, N]
kernel through XLA's dots (or through the same loop reading [K, N] in short strided runs).
`pack_projections(model)` swaps each layer's q/k/v/o and gate/up/down `nnx.Linear` (and an
untied LM head) for a `PackedLinear` holding the packed kernel, in place; the weights are not
duplicated. It applies where the kernel runs and pays: a one-device CPU mesh, float32 weights,
layers looped in Python (the CPU layout), and a C++ compiler on the machine (`packable` says
why not otherwise). Measured against XLA's dots on the 2-core CPU (docs/BENCHMARKS.md §2),
SmolLM2's projections: 1.0x at 1 row, 1.4-1.5x at 8-16, 1.2x at 64 and at 2048 (a prefill
chunk).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from pallas_kernels.cpu import matmul, native


class PackedLinear(nnx.Module):
    """`nnx.Linear`'s y = x @ kernel + bias with the kernel packed in column panels
    ([ceil(N/W), K, W], `pallas_kernels.cpu.matmul.pack`); float32 in and out."""

    def __init__(self, linear: nnx.Linear) -> None:
        self.kernel = nnx.Param(matmul.pack(linear.kernel[...]))
        self.bias = None if linear.bias is None else nnx.Param(linear.bias[...])
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def __call__(self, x: jax.Array) -> jax.Array:
        """x f32[..., K] -> f32[..., N]."""
        y = matmul.packed_matmul(x, self.kernel[...], self.out_features)
        return y if self.bias is None else y + self.bias[...]


PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
               "mlp": ("gate_proj", "up_proj", "down_proj")}


def packable(model: nnx.Module) -> str | None:
    """None when `pack_projections` applies to `model`, else why not (one line)."""
    mesh = model.mesh  # an AbstractMesh (lowering for absent devices) has no platform
    if not isinstance(mesh, Mesh) or mesh.size != 1 or mesh.devices.flat[0].platform != "cpu":
        return "packed projections are for a one-device CPU mesh"
    if jnp.dtype(model.dtype) != jnp.float32:
        return f"packed projections are float32 (the model is {jnp.dtype(model.dtype)})"
    if not isinstance(model.layers, nnx.List):
        return "packed projections need the looped layer layout (scan_layers=False)"
    return native.available()


def pack_projections(model: nnx.Module) -> int:
    """Swap `model`'s projections for `PackedLinear`s in place; returns how many were packed
    (0 when `packable` says no)."""
    if packable(model) is not None:
        return 0
    count = 0
    for block in model.layers:
        for part, names in PROJECTIONS.items():
            module = getattr(block, part)
            for name in names:
                setattr(module, name, PackedLinear(getattr(module, name)))
                count += 1
    if isinstance(model.lm_head, nnx.Linear):
        model.lm_head = PackedLinear(model.lm_head)
        count += 1
    return count
