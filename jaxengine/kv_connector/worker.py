"""`KVWorker`: the worker side of a KV connector, as the engine calls it around each step.

vLLM's `KVConnectorBase_V1` is one class with two roles; here the scheduler's role is the pure
`scheduler.KVConnector` (docs/SCHEDULING.md §11) and this is the worker's, which the engine
holds as one object and calls at fixed points without knowing which kind it is:

- `add_request` (after `check_request`): a request is queued, with what its
  `kv_transfer_params` asked;
- `connector`: the scheduler side, passed to every `schedule()`, `update_from_output()` and
  `abort_requests()` call;
- `start_step`: between `schedule()` and the step's dispatch, carry out the plan's
  `kv_connector_metadata` (vLLM's `bind_connector_metadata` + `start_load_kv`);
- `take_output`: with the step's tokens, the transfers finished since (vLLM's `get_finished`
  and `get_block_ids_with_load_errors`, as one `KVConnectorOutput`);
- `finish_request`: a request finished or was aborted; the `kv_transfer_params` its output
  carries (the second half of vLLM's `request_finished`);
- `record`: the worker's numbers into a step's statistics (vLLM's `get_kv_connector_stats`);
- `shutdown`: the engine is shut down; stop what the worker started (vLLM's name).

The base class is the worker of an engine without a connector: it moves nothing, and refuses
`kv_transfer_params`. `EngineArgs` allow one connector per engine (no `MultiConnector` yet).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scheduler import KVConnector, KVConnectorOutput, SchedulerOutput, SchedulerState

if TYPE_CHECKING:
    from jaxengine.engine.stats import IterationStats


class KVWorker:
    """Moves KV blocks between the engine's pool and a store outside it; this base moves none.

    Subclasses set `connector` and override what they do; the defaults do nothing.
    """

    connector: KVConnector | None = None  # the scheduler side (None: no connector)
    records_stats = False  # True: `record` must see every step's statistics

    def check_request(self, kv_transfer_params: Any, num_prompt_tokens: int) -> object:
        """What a request's `kv_transfer_params` ask of this worker, checked; changes nothing.

        Args:
          kv_transfer_params: the request's (`SamplingParams.extra_args["kv_transfer_params"]`).
          num_prompt_tokens: its prompt's length.
        Returns:
          What `add_request` takes for it.
        Raises:
          ValueError: they cannot be served here (the message names the key); this worker
            takes none.
        """
        raise ValueError("kv_transfer_params need an engine started with kv_transfer_config "
                         "(a prefill or decode instance)")

    def add_request(self, request_id: str, asked: object) -> None:
        """Register a queued request (`asked`: what `check_request` returned, or None)."""

    def start_step(self, plan: SchedulerOutput, state: SchedulerState, *, idle: bool) -> None:
        """Carry out a plan's transfers before its model step is dispatched.

        Args:
          plan: the step's plan (its `kv_connector_metadata`: loads, saves, evicted blocks).
          state: the state `schedule()` returned with it.
          idle: the engine has nothing to compute or collect this step (a worker waiting for
            transfers may wait briefly rather than have the engine spin).
        """

    def take_output(self) -> KVConnectorOutput | None:
        """The transfers finished since the last call, for `update_from_output` (None: none)."""
        return None

    def finish_request(self, request_id: str, *, held_blocks: tuple[int, ...] | None,
                       num_prompt_tokens: int) -> dict[str, Any] | None:
        """A request finished or was aborted: forget it.

        Args:
          request_id: the request.
          held_blocks: its blocks, when the scheduler holds them for this worker (None: freed).
          num_prompt_tokens: its prompt's length.
        Returns:
          The `kv_transfer_params` its final output carries (None: none).
        """
        return None

    def record(self, stats: IterationStats) -> None:
        """Add this worker's numbers since the last call to a step's statistics."""

    def check_update_weights(self) -> None:
        """Raise `ValueError` (naming the setting) if new model weights would leave KV of the
        old ones in this worker's store; `LLMEngine.update_weights` asks first."""

    def shutdown(self) -> None:
        """Stop what this worker started (a server, threads); it is not called again."""
