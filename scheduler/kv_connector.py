"""The scheduler side of a KV connector, shaped for the pure scheduler (docs/SCHEDULING.md §11).

A KV connector moves KV blocks between the device pool and somewhere else (host memory, disk,
another engine). In vLLM V1 (`KVConnectorBase_V1`) its scheduler half is a stateful object the
scheduler calls into. Here the scheduler stays pure, so the exchange is split by direction:

- **answers, in.** `KVConnector` is a read-only oracle passed to `schedule()` (and to
  `update_from_output()` / `abort_requests()`): `get_num_new_matched_tokens` (how many tokens
  past the local prefix-cache hit the external store can supply, and whether the load is
  asynchronous) and `request_finished` (whether to keep a finished request's blocks until they
  are saved). Its methods must not change anything: the scheduler may call them any number of
  times, also on states it later discards.
- **requests, out.** The plan's `kv_connector_metadata` (`KVConnectorMetadata`, vLLM's name)
  lists what the worker must do for this step: loads into freshly allocated blocks, saves of
  finished requests' held blocks, and cached blocks whose content this step overwrites.
- **results, in.** `KVConnectorOutput` (vLLM's name and fields) reports, with a step's model
  output, which loads and saves have finished and which blocks failed to load.
"""

from dataclasses import dataclass

from scheduler.kv.hashing import BlockHash
from scheduler.policies.request_view import RequestView


class KVConnector:
    """Scheduler-side answers of a KV connector: pure queries (the default supplies nothing).

    Subclass and override; an instance is passed to `schedule(state, kv_connector=...)`. A
    connector whose store changes between steps passes a new (or updated) instance each step:
    the scheduler keeps no reference to it.
    """

    def get_num_new_matched_tokens(self, request: RequestView,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many tokens beyond the local hit the external store can load for a waiting
        request about to be admitted (vLLM's method of the same name).

        Args:
            request: the request (valid during this call only). Its token ids are
                `prompt_token_ids` plus `output_token_ids`; `cache_salt` isolates its prefix.
            num_computed_tokens: the tokens the local prefix cache supplies (whole blocks).
        Returns:
            (tokens, load_async): `tokens` past `num_computed_tokens` that can be loaded, at
            most `num_tokens - num_computed_tokens` (None: not known yet, ask again next step;
            the request is skipped meanwhile); `load_async` True when the load runs between
            steps (the request then waits in WAITING_FOR_REMOTE_KVS), False when it happens
            inside the step that computes the rest. `load_async` must be False when `tokens`
            is 0.
        """
        return 0, False

    def request_finished(self, request: RequestView, block_ids: tuple[int, ...]) -> bool:
        """A request finished (stopped, hit a limit, or was aborted): should its blocks stay
        allocated until the connector has saved them (vLLM's `delay_free_blocks`)?

        Args:
            request: the finished request (valid during this call only).
            block_ids: its block table.
        Returns:
            True to hold the blocks: the next plan lists a `KVSave` for them, and they are
            freed when a `KVConnectorOutput.finished_sending` names the request.
        """
        return False


@dataclass(frozen=True, slots=True, kw_only=True)
class KVLoad:
    """Load external KV into a request's blocks (vLLM: `update_state_after_alloc`)."""

    req_id: str
    block_ids: tuple[int, ...]  # the request's whole block table
    num_computed_tokens: int  # the local prefix-cache hit: tokens 0..this-1 are on device
    num_external_tokens: int  # load tokens num_computed_tokens..+this-1 into block_ids
    load_async: bool  # True: between steps, report in finished_recving; False: this step,
    # before the forward pass that computes the rest


@dataclass(frozen=True, slots=True, kw_only=True)
class KVSave:
    """Save a finished request's blocks, held until `finished_sending` names it."""

    req_id: str
    block_ids: tuple[int, ...]  # its block table (not freed until the save is reported)
    token_ids: tuple[int, ...]  # the tokens whose KV the blocks hold, in order
    block_hashes: tuple[BlockHash, ...]  # prefix-cache hashes of its full blocks, in order


@dataclass(frozen=True, slots=True, kw_only=True)
class KVConnectorMetadata:
    """What the worker side must do for one step (the plan's `kv_connector_metadata`)."""

    loads: tuple[KVLoad, ...] = ()  # admitted in this step, in admission order
    saves: tuple[KVSave, ...] = ()  # finished since the previous plan
    # Cached blocks that this step reallocates: (block id, the hash it held). Their content
    # is overwritten by this step's forward pass, so copy them out before it runs.
    evicted_blocks: tuple[tuple[int, BlockHash], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class KVConnectorOutput:
    """What the worker side reports with a step's model output (vLLM's `KVConnectorOutput`)."""

    finished_recving: frozenset[str] = frozenset()  # async loads done (or given up)
    finished_sending: frozenset[str] = frozenset()  # saves of held blocks done
    invalid_block_ids: frozenset[int] = frozenset()  # blocks whose load failed

    def __post_init__(self) -> None:
        for name in ("finished_recving", "finished_sending", "invalid_block_ids"):
            object.__setattr__(self, name, frozenset(getattr(self, name)))
