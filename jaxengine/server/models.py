"""The models a server answers to (vLLM's `OpenAIServingModels`): the base model, and the LoRA
adapters served on it, each by the name a request passes as `model`.

Adapters come from `jaxengine serve --enable-lora --lora-modules name=path ...` (loaded before the
server takes requests; one that does not load stops the start) and, when the environment allows
it (vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`), from `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` at run time. Each adapter gets the next `lora_int_id` from 1 (vLLM's
counter: an id is never reused, so a reloaded adapter is never mistaken for its old weights).
Loading goes through the engine (`add_lora`), which reads and checks the adapter: one it refuses
is a 400 naming what is wrong, and the server keeps serving.
"""

from __future__ import annotations

import dataclasses
import os

from jaxengine.server.args import RUNTIME_LORA_ENVS
from jaxengine.server.async_engine import AsyncEngine
from jaxengine.server.protocol import RequestError, RequestModel
from jaxengine.server.response_bodies import ModelCard
from scheduler.request import LoRARequest


class LoadLoRAAdapterRequest(RequestModel):
    """The body of `POST /v1/load_lora_adapter` (vLLM's)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestModel):
    """The body of `POST /v1/unload_lora_adapter` (vLLM's; `lora_int_id`, if given, must be
    the adapter's)."""

    lora_name: str
    lora_int_id: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _Served:
    """An adapter the server serves: the engine's request for it and its parent's name."""

    request: LoRARequest
    parent: str


class ServedModels:
    """The base model and its adapters by served name; loads and unloads adapters through the
    engine."""

    def __init__(self, engine: AsyncEngine, base_model_name: str, *, enable_lora: bool,
                 runtime_updates: bool = False) -> None:
        """Serve `base_model_name`; adapters only if the engine was built with `enable_lora`,
        and clients may load and unload them only with `runtime_updates`."""
        self.engine = engine
        self.base_model_name = base_model_name
        self.enable_lora = enable_lora
        self.runtime_updates = runtime_updates
        self._adapters: dict[str, _Served] = {}
        self._last_id = 0

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model (or no `model`).

        Raises:
          RequestError: 404 (vLLM's) for a name served here as neither.
        """
        if model is None or model == self.base_model_name:
            return None
        served = self._adapters.get(model)
        if served is None:
            names = ", ".join(f"`{n}`" for n in [self.base_model_name, *self._adapters])
            raise RequestError(f"The model `{model}` does not exist; this server serves "
                               f"{names} (see /v1/models).", "model", code=404)
        return served.request

    def cards(self, *, created: int, root: str, max_model_len: int) -> list[ModelCard]:
        """`/v1/models`' entries: the base model, then each adapter (its directory as `root`,
        the model it adapts as `parent`: vLLM's shape)."""
        base = ModelCard(id=self.base_model_name, created=created, root=root,
                         max_model_len=max_model_len)
        return [base] + [ModelCard(id=name, created=created, root=s.request.lora_path,
                                   parent=s.parent) for name, s in self._adapters.items()]

    def check_runtime_updates(self) -> None:
        """Raise unless clients may load and unload adapters.

        Raises:
          RequestError: 404, as vLLM's (which has no such route then), saying what turns
            them on.
        """
        if not self.runtime_updates:
            raise RequestError("loading and unloading LoRA adapters at run time is off; start "
                               f"the server with {RUNTIME_LORA_ENVS[0]}=True in its "
                               "environment", code=404)

    async def load(self, name: str, path: str, base_model_name: str | None = None) -> str:
        """Load adapter `path` as `name` (vLLM's `load_lora_adapter`); returns vLLM's message.

        Raises:
          RequestError: 400 for LoRA not enabled, a missing field, a name already served, or
            an adapter the engine refuses (its message says why); 404 for a path that does not
            exist. Nothing changes then.
        """
        if not self.enable_lora:
            raise RequestError("LoRA adapters are not enabled on this server; start it with "
                               "--enable-lora", "lora_name")
        if not name or not path:
            raise RequestError("Both 'lora_name' and 'lora_path' must be provided.",
                               "lora_name" if not name else "lora_path")
        if name in self._adapters or name == self.base_model_name:
            raise RequestError(f"The lora adapter '{name}' has already been loaded.",
                               "lora_name")
        if not os.path.exists(path):
            raise RequestError(f"No adapter found for lora_path={path!r}: no such directory "
                               "on the server", "lora_path", code=404)
        self._last_id += 1
        request = LoRARequest(lora_name=name, lora_int_id=self._last_id, lora_path=path)
        try:
            await self.engine.add_lora(request)
        except ValueError as e:
            raise RequestError(f"LoRA adapter '{name}' cannot be loaded: {e}",
                               "lora_path") from None
        self._adapters[name] = _Served(request, base_model_name or self.base_model_name)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str, lora_int_id: int | None = None) -> str:
        """Stop serving adapter `name` (vLLM's `unload_lora_adapter`); returns vLLM's
        message.

        Raises:
          RequestError: 400 without a name or with a `lora_int_id` other than the adapter's,
            404 for a name not loaded.
        """
        if not name:
            raise RequestError("'lora_name' needs to be provided to unload a LoRA adapter.",
                               "lora_name")
        served = self._adapters.get(name)
        if served is None:
            raise RequestError(f"The lora adapter '{name}' cannot be found.", "lora_name",
                               code=404)
        if lora_int_id not in (None, served.request.lora_int_id):
            raise RequestError(f"lora_int_id={lora_int_id} does not match adapter '{name}' "
                               f"(lora_int_id {served.request.lora_int_id}); leave it out or "
                               "send that one", "lora_int_id")
        del self._adapters[name]
        await self.engine.remove_lora(served.request.lora_int_id)
        return f"Success: LoRA adapter '{name}' removed successfully."
