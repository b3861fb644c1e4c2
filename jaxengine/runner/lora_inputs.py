"""The runner's side of LoRA: the adapter slots on the device, which adapter holds which slot,
and each batch's token slots (the model's side is jaxengine/model/lora.py).

An adapter is written into a slot by one small jitted program with the slots donated (in
place; the slot index traced, so one program serves every slot and adapter, made with the
runner's others and, like them, loaded whole when saved before): loading or evicting an
adapter compiles nothing. A slot whose adapter a
step in flight still reads may be overwritten for the next step: JAX lets that step's reads of
the donated buffers finish before the write runs (the device runs programs in order), so
`max_loras` slots serve async scheduling too, where two plans of `max_loras` adapters each
overlap.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence

import jax
import numpy as np

from jaxengine.model.lora import LoRALayout, LoRASlots, write_slot
from jaxengine.runner.bucket_programs import abstract, make_program, spec
from jaxengine.runner.config import RunnerConfig

WRITE_LORA_NAME = "jaxengine_write_lora_slot"


def jaxengine_write_lora_slot(slots: LoRASlots, slot: jax.Array, a: dict[str, jax.Array],
                              b: dict[str, jax.Array], scaling: jax.Array) -> LoRASlots:
    """`jaxengine.model.lora.write_slot` under the name compile counting keys on."""
    return write_slot(slots, slot, a, b, scaling)


_jitted_write = jax.jit(jaxengine_write_lora_slot, donate_argnames=("slots",))


class LoRAInputs:
    """The device slots (`slots`, replaced by each write) and the adapters in them."""

    def __init__(self, layout: LoRALayout, *, max_loras: int, max_lora_rank: int) -> None:
        """`max_loras` empty slots of rank `max_lora_rank` beside the zero slot 0."""
        self.layout, self.max_lora_rank = layout, max_lora_rank
        self.slots = layout.init_slots(max_loras + 1, max_lora_rank)
        # lora_int_id -> its slot, least recently used first
        self._slot_of: OrderedDict[int, int] = OrderedDict()
        self._free = list(range(max_loras, 0, -1))  # pop() hands out slot 1 first
        # The slot writer: jitted until `precompile` gives its executable, called from then on
        # (as the penalty slot writer, jaxengine/runner/penalty_inputs.py).
        self._write: Callable[..., LoRASlots] = _jitted_write

    def slot_of(self, lora_int_id: int) -> int | None:
        """The adapter's slot, or None if it is not on the device."""
        return self._slot_of.get(lora_int_id)

    def loaded(self) -> tuple[int, ...]:
        """The ids of the adapters on the device, least recently used first."""
        return tuple(self._slot_of)

    def use(self, lora_int_id: int, weights: Mapping[str, tuple[np.ndarray, np.ndarray]],
            scaling: float, *, keep: Collection[int]) -> int:
        """The adapter's slot, writing it there first if it is not on the device: into a free
        slot, else into that of the least recently used adapter not in `keep` (the ids the
        step being packed uses, at most `max_loras`: the scheduler's limit).

        Args:
            weights: module -> (A [Ly, r, in], B [Ly, out, r]), `LoRAAdapter.weights`.
            scaling: the adapter's `LoRAAdapter.scaling`.
        Raises:
            ValueError: a module the model serves no LoRA on (`LoRALayout.slot_arrays`).
        """
        slot = self._slot_of.get(lora_int_id)
        if slot is not None:
            self._slot_of.move_to_end(lora_int_id)
            return slot
        a, b = self.layout.slot_arrays(weights, self.max_lora_rank)
        if not self._free:
            victim = next(i for i in self._slot_of if i not in keep)
            self._free.append(self._slot_of.pop(victim))
        slot = self._free.pop()
        self.slots = self._write(self.slots, np.int32(slot), a, b, np.float32(scaling))
        self._slot_of[lora_int_id] = slot
        return slot

    def remove(self, lora_int_id: int) -> bool:
        """Free the adapter's slot (its contents stay until reused: no token reads it);
        False if it was not on the device."""
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is None:
            return False
        self._free.append(slot)
        return True

    def precompile(self, *, signature: str | None, devices: Sequence[jax.Device]) -> None:
        """Make the slot writer's executable, which later writes call, as the runner makes its
        other programs (`make_program`: loaded whole when saved before; `signature` and
        `devices` as there)."""
        a, b = self.layout.slot_arrays({}, self.max_lora_rank)
        args = (abstract(self.slots), spec(np.int32(0)), jax.tree.map(spec, a),
                jax.tree.map(spec, b), spec(np.float32(0)))
        self._write = make_program("the LoRA slot writer", WRITE_LORA_NAME, _jitted_write, args,
                                   {}, signature=signature, devices=devices)


def lora_inputs_for(layout: LoRALayout | None, config: RunnerConfig) -> LoRAInputs | None:
    """A runner's adapter slots when `config` asks for LoRA (None otherwise), for a model of
    `layout` (`ModelFns.lora_layout`).

    Raises:
      ValueError: LoRA asked of a model that serves no adapters.
    """
    if not config.max_loras:
        return None
    if layout is None:
        raise ValueError("enable_lora: this model serves no LoRA adapters (it has no "
                         "lora_layout; the fake model has none)")
    return LoRAInputs(layout, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank)


def token_slots(query_start_loc: np.ndarray, request_slots: Sequence[int], num_tokens: int
                ) -> np.ndarray:
    """i32[T]: each token's slot, from each request's (in batch order) and the batch's
    `query_start_loc` (i32[R+1]); padding tokens 0."""
    out = np.zeros(num_tokens, np.int32)
    for r, slot in enumerate(request_slots):
        out[query_start_loc[r]:query_start_loc[r + 1]] = slot
    return out
