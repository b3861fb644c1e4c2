"""The engine's LoRA adapters (vLLM's `add_lora` / `remove_lora` / `list_loras`): read from
their PEFT directories into host memory, kept there up to `max_cpu_loras` (least recently used
out first; one evicted is read again from its path when a request needs it), and put into the
runner's device slots before the step that uses them (`slots_for`).

The scheduler lets a step carry at most `max_loras` distinct adapters (docs/SCHEDULING.md
§14), and the runner has `max_loras` slots: each plan's adapters are loaded into them before
it is dispatched, evicting adapters that plan does not use. Under async scheduling the step in
flight may still read a slot being rewritten for the next one; the device runs the write after
that step (jaxengine/runner/lora_inputs.py), so nothing more is needed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from jaxengine.config import LoRAConfig
from jaxengine.loading.lora import LoRAAdapter, load_peft_adapter
from jaxengine.runner.lora_inputs import LoRAInputs
from scheduler import LoRARequest

if TYPE_CHECKING:
    from jaxengine.runner.runner import Runner


class LoRAAdapters:
    """The adapters an engine knows: on the host (LRU), and which the device holds."""

    def __init__(self, config: LoRAConfig, device: LoRAInputs) -> None:
        self.config, self.device = config, device
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU first
        self._requests: dict[int, LoRARequest] = {}  # each id's adapter, as first added

    @classmethod
    def over(cls, config: LoRAConfig, runner: Runner) -> LoRAAdapters:
        """The adapters of an engine over `runner`, put into its adapter slots.

        Raises:
          ValueError: a runner without them (the simulator's cost runner prices no adapters).
        """
        slots = getattr(runner, "lora", None)
        if slots is None:
            raise ValueError("enable_lora: this engine's runner has no LoRA adapter slots (the "
                             "simulator does not price adapters)")
        return cls(config, slots)

    def add(self, lora: LoRARequest) -> bool:
        """Read the adapter into host memory (if it is not there) and check it fits the
        model; True (vLLM's `add_lora`).

        Raises:
          ValueError: an id already used by another name or path, an adapter that cannot be
            read, of a rank above `max_lora_rank`, targeting a module this model serves no
            adapter on, or made for another base model (each named).
        """
        known = self._requests.get(lora.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (lora.lora_name,
                                                                         lora.lora_path):
            raise ValueError(f"lora_int_id={lora.lora_int_id} is already adapter "
                             f"{known.lora_name!r} at {known.lora_path!r}; give "
                             f"{lora.lora_name!r} another lora_int_id")
        self._adapter(lora)
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Forget the adapter, on the host and the device; False if it was unknown."""
        known = self._requests.pop(lora_int_id, None) is not None
        self._host.pop(lora_int_id, None)
        return self.device.remove(lora_int_id) or known

    def list(self) -> set[int]:
        """The ids of the adapters in host memory (vLLM's `list_loras`)."""
        return set(self._host)

    def slots_for(self, requests: Iterable[str],
                  lora_of: Callable[[str], LoRARequest | None]) -> dict[str, int]:
        """The device slot of each request's adapter (requests without one are left out),
        loading the adapters the device lacks first.

        Args:
          requests: the requests of the plan about to be dispatched (at most `max_loras`
            distinct adapters among them: the scheduler's limit).
          lora_of: each request's adapter.
        """
        adapters = {rid: lora for rid in requests if (lora := lora_of(rid)) is not None}
        keep = {lora.lora_int_id for lora in adapters.values()}
        slots: dict[int, int] = {}
        for lora in adapters.values():
            if lora.lora_int_id not in slots:
                adapter = self._adapter(lora)
                slots[lora.lora_int_id] = self.device.use(lora.lora_int_id, adapter.weights,
                                                          adapter.scaling, keep=keep)
        return {rid: slots[lora.lora_int_id] for rid, lora in adapters.items()}

    def _adapter(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter from host memory, read from its path if it is not there (evicting the
        least recently used beyond `max_cpu_loras`)."""
        adapter = self._host.get(lora.lora_int_id)
        if adapter is not None:
            self._host.move_to_end(lora.lora_int_id)
            return adapter
        layout = self.device.layout
        adapter = load_peft_adapter(lora.lora_path, layout.model_config,
                                    max_lora_rank=self.config.max_lora_rank)
        layout.check(adapter.weights)
        self._requests.setdefault(lora.lora_int_id, lora)
        self._host[lora.lora_int_id] = adapter
        while len(self._host) > self.config.max_cpu_loras:
            self._host.popitem(last=False)
        return adapter
