"""Multi-LoRA on the device: the adapter slots and the per-token low-rank update.

Adapters live in S = max_loras + 1 fixed slots, slot 0 all zeros (the base model). Per target
module the slots hold A [Ly, in, S*r] and B [Ly, S*r, out], slot s in columns (rows) s*r to
(s+1)*r (kernel layout, [in, out] as the base projections' kernels; r = max_lora_rank, a smaller
adapter zero-padded), and one scaling f32[S]. Every token of a batch carries its slot
(`ModelBatch.lora_slots`, i32[T]), and each targeted projection adds

    y[t] += scaling[s_t] * (x[t] @ A[s_t]) @ B[s_t],   s_t = lora_slots[t]

on top of whatever the base projection is (float, packed, int8, GGUF blocks): `project` in
layers.py is the one place that calls it. The slots are not gathered per token (that would be
T copies of [in, r]); x is multiplied by every slot's A at once, [T, S*r], the columns of
other slots are zeroed, and one matmul with all the B's, [S*r, out], sums only the token's
own: two plain [M, K] @ [K, N] dots (with the slot axis elsewhere, XLA's CPU dots ran the
update several times slower inside the model step). S is small, so this costs S times the rank
of one adapter, and the shapes never depend on which adapters are loaded: writing a slot
compiles nothing.

Under tensor parallelism A and B shard with their layer: a column-parallel projection
(q/k/v, gate/up, split on out) has B split on out and A whole; a row-parallel one (o, down,
split on in) has A split on in and B whole, so x @ A is a partial sum that GSPMD all-reduces
([T, S*r], small). With KV heads repeated (tp > K) the k/v B's heads are repeated as the
base kernels' are.

The slots are layer-first like the stacked layer weights: a looped model slices layer i,
a scanned one scans over them beside its blocks.
Axes: T tokens, S slots, r rank, Ly layers; mesh axis tp.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxengine.model.config import ModelConfig
from jaxengine.model.mesh import TP_AXIS
from jaxengine.model.tensor_parallel import TPLayout

ROW_PARALLEL = ("o_proj", "down_proj")  # split on in; the others on out


@jax.tree_util.register_dataclass
@dataclass(frozen=True, kw_only=True)
class LoRASlots:
    """The adapters on the device (a pytree, updated by value: `write_slot`)."""

    a: dict[str, jax.Array]  # module -> [Ly, in, S*r]; slot 0 (columns :r) zeros
    b: dict[str, jax.Array]  # module -> [Ly, S*r, out']; slot 0 (rows :r) zeros
    scaling: jax.Array  # f32[S]  each slot's alpha / r (or alpha / sqrt(r)); 0 in slot 0


@jax.tree_util.register_dataclass
@dataclass(frozen=True, kw_only=True)
class LayerLoRA:
    """One layer's slots and the batch's token slots: what its projections add."""

    a: dict[str, jax.Array]  # module -> [in, S*r]
    b: dict[str, jax.Array]  # module -> [S*r, out']
    scaling: jax.Array  # f32[S]
    token_slots: jax.Array  # i32[T]  each token's slot (0: no adapter)

    def add(self, module: str, x: jax.Array, y: jax.Array) -> jax.Array:
        """`y` [T, out'] (the base projection of x [T, in]) plus the tokens' adapters'
        update of `module`; `y` itself for a module no slot holds."""
        if module not in self.a:
            return y
        return y + lora_delta(x, self.a[module], self.b[module], self.scaling,
                              self.token_slots).astype(y.dtype)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, scaling: jax.Array,
               token_slots: jax.Array) -> jax.Array:
    """f32[T, out]: scaling[s_t] * (x[t] @ a[s_t]) @ b[s_t] for each token t, s_t its slot.

    Args:
        x: [T, in] the projection's input.
        a: [in, S*r], b: [S*r, out] the slots side by side.
        scaling: f32[S].
        token_slots: i32[T].
    """
    r = a.shape[1] // scaling.shape[0]
    h = jnp.dot(x, a.astype(x.dtype), preferred_element_type=jnp.float32)  # [T, S*r]
    mine = token_slots[:, None] == jnp.arange(a.shape[1])[None, :] // r  # [T, S*r]
    h = jnp.where(mine, h, 0.0)  # other slots' columns zeroed
    out = jnp.dot(h.astype(b.dtype), b, preferred_element_type=jnp.float32)  # [T, out]
    return out * scaling[token_slots][:, None]  # PEFT's order: B(A(x)) * scaling


def layer_lora(slots: LoRASlots | None, layer: int, token_slots: jax.Array | None
               ) -> LayerLoRA | None:
    """Layer `layer`'s `LayerLoRA` of a looped model (None without slots)."""
    if slots is None or token_slots is None:
        return None
    return LayerLoRA(a={m: v[layer] for m, v in slots.a.items()},
                     b={m: v[layer] for m, v in slots.b.items()}, scaling=slots.scaling,
                     token_slots=token_slots)


@dataclass(frozen=True, kw_only=True)
class LoRALayout:
    """Where a model's adapters go: the modules it serves them on, at its tensor-parallel
    layout, and the mesh and dtype of the slots."""

    model_config: ModelConfig  # the base model, which an adapter is read against
    num_layers: int
    modules: Mapping[str, tuple[int, int]]  # module -> (in, out') at the model's layout
    kv_repeat: int  # each KV head repeated this often in k/v's out axis (tp > K)
    head_dim: int
    mesh: Mesh
    dtype: jnp.dtype

    def shardings(self) -> LoRASlots:
        """The `NamedSharding` of each slot array, as a `LoRASlots` of shardings."""
        a = {m: NamedSharding(self.mesh, P(None, TP_AXIS if m in ROW_PARALLEL else None, None))
             for m in self.modules}
        b = {m: NamedSharding(self.mesh, P(None, None, None if m in ROW_PARALLEL else TP_AXIS))
             for m in self.modules}
        return LoRASlots(a=a, b=b, scaling=NamedSharding(self.mesh, P()))

    def init_slots(self, num_slots: int, rank: int) -> LoRASlots:
        """All `num_slots` slots zero, of rank `rank`, placed in their shardings."""
        sh = self.shardings()
        Ly = self.num_layers

        def zeros(shape: tuple[int, ...], sharding: NamedSharding) -> jax.Array:
            return jax.device_put(np.zeros(shape, self.dtype), sharding)

        Sr = num_slots * rank
        return LoRASlots(
            a={m: zeros((Ly, i, Sr), sh.a[m]) for m, (i, _) in self.modules.items()},
            b={m: zeros((Ly, Sr, o), sh.b[m]) for m, (_, o) in self.modules.items()},
            scaling=zeros((num_slots,), sh.scaling).astype(jnp.float32))

    def check(self, modules: Iterable[str]) -> None:
        """`ValueError` naming the modules of `modules` this model serves no LoRA on."""
        unknown = sorted(set(modules) - set(self.modules))
        if unknown:
            raise ValueError(f"adapter targets {', '.join(unknown)}, which this model serves "
                             f"no LoRA on (only {', '.join(self.modules)}; a mixture-of-experts "
                             f"model's gate/up/down are its experts)")

    def slot_arrays(self, weights: Mapping[str, tuple[np.ndarray, np.ndarray]], rank: int
                    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """One adapter's (A, B) per module in a slot's layout: A [Ly, in, rank] and
        B [Ly, rank, out'] in the slots' dtype, zero-padded to `rank`, k/v heads repeated;
        zeros for a module the adapter does not target.

        Args:
            weights: module -> (A [Ly, r, in], B [Ly, out, r]) at the checkpoint's sizes
                (`jaxengine.loading.lora.LoRAAdapter.weights`), r <= rank.
        Raises:
            ValueError: a module this model serves no adapter on (named).
        """
        self.check(weights)
        a_out, b_out = {}, {}
        for m, (fan_in, fan_out) in self.modules.items():
            a_out[m] = np.zeros((self.num_layers, fan_in, rank), self.dtype)
            b_out[m] = np.zeros((self.num_layers, rank, fan_out), self.dtype)
            if m not in weights:
                continue
            a, b = weights[m]
            r = a.shape[1]
            if m in ("k_proj", "v_proj") and self.kv_repeat > 1:
                Ly, out, _ = b.shape
                heads = b.reshape(Ly, out // self.head_dim, self.head_dim, r)
                b = np.repeat(heads, self.kv_repeat, axis=1).reshape(Ly, -1, r)
            a_out[m][:, :, :r] = np.swapaxes(a, 1, 2)
            b_out[m][:, :r, :] = np.swapaxes(b, 1, 2)
        return a_out, b_out


def lora_layout(cfg: ModelConfig, layout: TPLayout, *, mesh: Mesh, dtype: jnp.dtype
                ) -> LoRALayout:
    """The `LoRALayout` of a model of `cfg` laid out as `layout`: the attention projections,
    and the MLP's where the model has no experts (vLLM serves no LoRA on MoE experts)."""
    D, F, H = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * H, cfg.num_kv_heads * layout.kv_repeat * H
    modules = {"q_proj": (D, q), "k_proj": (D, kv), "v_proj": (D, kv), "o_proj": (q, D)}
    if not cfg.num_experts:
        modules |= {"gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D)}
    return LoRALayout(model_config=cfg, num_layers=cfg.num_layers, modules=modules,
                      kv_repeat=layout.kv_repeat, head_dim=H, mesh=mesh, dtype=jnp.dtype(dtype))


def write_slot(slots: LoRASlots, slot: jax.Array, a: dict[str, jax.Array],
               b: dict[str, jax.Array], scaling: jax.Array) -> LoRASlots:
    """`slots` with slot `slot` (i32[]) holding one adapter: A [Ly, in, r] and B [Ly, r, out']
    per module (`LoRALayout.slot_arrays`), `scaling` f32[]. Pure; jit it with `slots`
    donated, so the write is in place and, the slot traced, one program serves every slot."""
    def put(v: jax.Array, new: jax.Array, axis: int) -> jax.Array:
        start = [0, 0, 0]
        start[axis] = slot * new.shape[axis]  # slot s: columns (rows) s*r .. (s+1)*r
        return jax.lax.dynamic_update_slice(v, new.astype(v.dtype), start)

    return LoRASlots(a={m: put(v, a[m], 2) for m, v in slots.a.items()},
                     b={m: put(v, b[m], 1) for m, v in slots.b.items()},
                     scaling=slots.scaling.at[slot].set(scaling))
