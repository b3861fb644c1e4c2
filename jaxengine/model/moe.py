"""The sparse mixture-of-experts FFN of Mixtral, Qwen2-MoE and Qwen3-MoE.

A router picks `top_k` of `num_experts` SwiGLU experts per token; the (token, expert) pairs are
sorted by expert and run through a grouped matmul (jaxengine_kernels/grouped_matmul.py), so a
step costs the experts its tokens chose, not every expert on every token. Shapes are static
and the routing traced: one compilation serves every routing.

Routing follows transformers (modeling_mixtral.py, modeling_qwen2_moe.py,
modeling_qwen3_moe.py): router logits in the activation dtype, softmax over the experts in
float32, top-k, renormalised over the k when `norm_topk_prob` (Mixtral always), the weights
cast to the activation dtype. Qwen2-MoE adds a shared expert scaled by
sigmoid(shared_expert_gate(x)).

Over the mesh axis "tp" the experts are split one of two ways (docs/STYLE.md rule 17: declared
where the weights are created):
- tensor parallel (default): every device holds every expert's slice of the F axis (gate/up
  column-parallel, down row-parallel, like `MLP`); the partial sums meet in one all-reduce;
- expert parallel (vLLM's `enable_expert_parallel`): each device holds E/tp whole experts and
  runs only the pairs routed to them; one all-reduce sums the devices' outputs.
Both run per device under `jax.shard_map`; the router is replicated.
Axes: T tokens, D model, F expert width, E experts, k experts per token, M = T*k pairs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxengine.model.layers import MLP, _normal, linear, project
from jaxengine.model.mesh import TP_AXIS, mesh_platform, tp_size
from jaxengine_kernels.grouped_matmul import (
    GROUPED_IMPLS,
    GroupedImpl,
    default_grouped_impl,
    grouped_matmul,
)

REPLICATED = (None, None)  # a kernel [in, out] every device holds whole


class Experts(nnx.Module):
    """The routed experts' SwiGLU weights, one matrix per expert in our [in, out] layout:
    `gate_proj`, `up_proj` [E, D, F] and `down_proj` [E, F, D] (HF stores each expert's
    [out, in], Mixtral's gate and up fused)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 expert_parallel: bool, mesh: Mesh, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        E, D, F = num_experts, hidden_size, intermediate_size
        if expert_parallel:
            gate_up = down = (TP_AXIS, None, None)  # E/tp whole experts per device
        else:
            gate_up, down = (None, None, TP_AXIS), (None, TP_AXIS, None)  # F/tp of each
        self.gate_up_spec, self.down_spec = P(*gate_up), P(*down)

        def param(shape: tuple[int, ...], sharding: tuple[str | None, ...]) -> nnx.Param:
            init = nnx.with_partitioning(_normal, sharding, mesh=mesh)
            return nnx.Param(init(rngs.params(), shape, dtype))

        self.gate_proj = param((E, D, F), gate_up)
        self.up_proj = param((E, D, F), gate_up)
        self.down_proj = param((E, F, D), down)

    def operands(self) -> tuple[tuple[jax.Array, P], ...]:
        """The arrays the grouped matmuls read, each with its split over "tp" (the
        `shard_map` specs): gate, up, down."""
        return ((self.gate_proj[...], self.gate_up_spec), (self.up_proj[...], self.gate_up_spec),
                (self.down_proj[...], self.down_spec))

    @staticmethod
    def matrices(*local: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One device's gate, up [E_local, D, F_local] and down [E_local, F_local, D] in
        `dtype` from its blocks of `operands()` (the float weights as they are)."""
        del dtype  # float experts are held in the activation dtype already
        gate, up, down = local
        return gate, up, down


class SparseMoE(nnx.Module):
    """Router, routed experts and (Qwen2-MoE) a gated shared expert."""

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_experts: int,
                 top_k: int, *, norm_topk_prob: bool, shared_intermediate_size: int | None = None,
                 expert_parallel: bool = False, mesh: Mesh, dtype: jnp.dtype, rngs: nnx.Rngs,
                 grouped_impl: GroupedImpl | None = None) -> None:
        """Fresh weights N(0, 0.02) at the checkpoint's sizes.

        Args:
            hidden_size: D.
            moe_intermediate_size: F, each routed expert's width.
            num_experts: E.
            top_k: experts per token (HF `num_experts_per_tok`).
            norm_topk_prob: renormalise the k weights to sum to one (Mixtral: True).
            shared_intermediate_size: the shared expert's width (Qwen2-MoE), or None.
            expert_parallel: split the experts over "tp" whole, not their F axis.
            mesh: the devices the weights are placed on.
            grouped_impl: the grouped matmul's implementation; default for the platform.
        Raises:
            ValueError: top_k outside 1..E, an unknown grouped_impl, or a size the mesh cannot
                split (E with expert_parallel, F without); the message names the field.
        """
        E, tp = num_experts, tp_size(mesh)
        if not 1 <= top_k <= E:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and "
                             f"num_experts={E}")
        if grouped_impl is not None and grouped_impl not in GROUPED_IMPLS:
            raise ValueError(f"grouped_impl={grouped_impl!r} is unknown; use one of "
                             f"{GROUPED_IMPLS}")
        if expert_parallel and E % tp:
            raise ValueError(f"enable_expert_parallel splits num_experts={E} over "
                             f"tensor_parallel_size={tp} devices, which does not divide it; "
                             f"use a tensor_parallel_size that divides {E}, or no expert "
                             f"parallelism")
        split = {"shared_expert_intermediate_size": shared_intermediate_size}
        if not expert_parallel:  # each expert's F axis is split
            split["moe_intermediate_size"] = moe_intermediate_size
        for name, size in split.items():
            if size is not None and size % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide the model's "
                                 f"{name}={size}")
        D = hidden_size
        self.gate = linear(D, E, sharding=REPLICATED, mesh=mesh, dtype=dtype, rngs=rngs)
        self.experts = Experts(E, D, moe_intermediate_size, expert_parallel=expert_parallel,
                               mesh=mesh, dtype=dtype, rngs=rngs)
        shared = shared_intermediate_size is not None
        self.shared_expert = (MLP(D, shared_intermediate_size, mesh=mesh, dtype=dtype,
                                  rngs=rngs) if shared else None)
        self.shared_expert_gate = (linear(D, 1, sharding=REPLICATED, mesh=mesh, dtype=dtype,
                                          rngs=rngs) if shared else None)
        self.num_experts, self.top_k, self.norm_topk_prob = E, top_k, norm_topk_prob
        self.expert_parallel = expert_parallel
        self.grouped_impl = grouped_impl
        self.mesh = mesh

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The experts each token goes to and their weights, as transformers computes them.

        Args:
            x: [T, D].
        Returns:
            (experts i32[T, k], weights [T, k] in x's dtype), the experts by falling weight.
        """
        logits = self.gate(x).astype(jnp.float32)  # [T, E], rounded to x's dtype as HF's
        weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), self.top_k)
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return experts.astype(jnp.int32), weights.astype(x.dtype)

    def __call__(self, x: jax.Array, live: jax.Array | None = None) -> jax.Array:
        """x [T, D] -> [T, D].

        Args:
            live: i32[] the rows that are real tokens (the rest is a bucket's padding, routed
                to no expert: it costs no expert work and its output is the shared expert's,
                or zero); None: every row.
        """
        T = x.shape[0]
        experts, weights = self.route(x)
        if live is not None:  # expert E sorts after every real one and is in no group
            experts = jnp.where(jnp.arange(T)[:, None] < live, experts, self.num_experts)
        impl = self.grouped_impl or default_grouped_impl(mesh_platform(self.mesh), x.dtype)
        arrays, specs = zip(*self.experts.operands(), strict=True)
        routed = jax.shard_map(
            functools.partial(_local_experts, matrices=self.experts.matrices,
                              expert_parallel=self.expert_parallel, impl=impl),
            mesh=self.mesh,
            in_specs=(P(), P(), P(), *specs),
            out_specs=P(),
            check_vma=False)  # the tile loop's carry starts unvaried
        out = routed(x, experts, weights, *arrays)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = jax.nn.sigmoid(project(self.shared_expert_gate, x, live))  # [T, 1]
            out = out + gate * self.shared_expert(x, live)
        return out


def _local_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, *local: jax.Array,
                   matrices: Callable[..., tuple[jax.Array, jax.Array, jax.Array]],
                   expert_parallel: bool, impl: GroupedImpl) -> jax.Array:
    """One device's part of the routed experts, summed over the devices.

    Args:
        x: [T, D] replicated.
        experts: i32[T, k] global expert ids; num_experts for a padding row.
        weights: [T, k] in x's dtype.
        local: this device's blocks of the experts' `operands()`, which `matrices` turns into
            gate, up [E_local, D, F_local] and down [E_local, F_local, D] (expert parallel:
            this device's E/tp experts whole; else every expert's F/tp slice).
    Returns:
        [T, D] in x's dtype, replicated.
    """
    gate, up, down = matrices(*local, dtype=x.dtype)
    T, k = experts.shape
    E_local = gate.shape[0]
    offset = jax.lax.axis_index(TP_AXIS) * E_local if expert_parallel else 0
    local = experts.reshape(-1) - offset  # i32[M]
    # Pairs of another device's experts (and padding rows) go to no group: sorted last and
    # counted out of the group sizes, they cost no expert work and come out zero.
    local = jnp.where((local >= 0) & (local < E_local), local, E_local)
    order = jnp.argsort(local, stable=True)  # i32[M] pairs by expert
    sizes = jnp.zeros((E_local,), jnp.int32).at[local].add(1, mode="drop")  # i32[E_local]
    rows = x[order // k]  # [M, D] each pair's token, sorted
    hidden = (jax.nn.silu(grouped_matmul(rows, gate, sizes, impl=impl))
              * grouped_matmul(rows, up, sizes, impl=impl))  # [M, F_local]
    y = grouped_matmul(hidden, down, sizes, impl=impl)  # [M, D]
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))  # i32[M]
    y = y[inverse].reshape(T, k, -1) * weights[:, :, None]  # [T, k, D]
    out = jnp.sum(y.astype(jnp.float32), axis=1).astype(x.dtype)
    return jax.lax.psum(out, TP_AXIS)
