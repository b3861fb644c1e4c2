"""The scheduler's values: `SchedulerState` (frozen), the plan of one step, and result deltas.

A state keeps per-request progress as small columns (read-only dicts keyed by request id) that
each pure function copies before changing, and everything large in one `StateData` (the KV pool
and the token histories) reached through a `scheduler._versioned.Version`: versions share that
data without copying it, and each sees exactly its own content (the module explains how). Only
`scheduler/core/_work.py` changes it, and only through the version's journal. `state.requests`
rebuilds public `Request` values from both on access; for readers that must not pay for that
(`invariants.py`, `prefix_query.py`), the state hands out its columns as they are (read-only)
and reads its shared data under the lineage's lock (`read_data`).
"""

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from scheduler._versioned import Version
from scheduler.config import SchedulerConfig
from scheduler.core.kv_transfer import NO_TRANSFERS, KVTransfers
from scheduler.kv.kv_cache import PoolData
from scheduler.kv_connector import KVConnectorMetadata
from scheduler.request import Request, RequestStatus, SamplingParams

_EMPTY: Mapping = MappingProxyType({})

# An input token the plan cannot name yet: under async scheduling, the token the step in flight
# is sampling. The runner fills it on the device from that step's output.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerCounters:
    """Cumulative counters (prefix-cache lookups are counted per admission)."""

    prefix_cache_queries: int = 0  # tokens looked up at first admissions
    prefix_cache_hits: int = 0  # of those, tokens found cached
    preempted_prefix_cache_queries: int = 0  # the same for re-admissions after preemption
    preempted_prefix_cache_hits: int = 0
    num_preemptions: int = 0  # preemptions so far
    # With a KV connector (docs/SCHEDULING.md §11), per admission: tokens asked of it (those
    # past the local hit) and tokens it supplied (vLLM's connector_prefix_cache_stats).
    connector_prefix_cache_queries: int = 0
    connector_prefix_cache_hits: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerStats(SchedulerCounters):
    """A snapshot for metrics: queue sizes, KV usage and the cumulative counters."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # used blocks / usable blocks (cached free blocks are free)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class SchedulerState:
    """Everything the scheduler knows, as a value. Build the first with `init_state`."""

    config: SchedulerConfig
    step: int = 0  # schedule() calls so far
    waiting: tuple[str, ...] = ()  # in policy order
    running: tuple[str, ...] = ()  # in admission order
    num_free_blocks: int  # free blocks, cached ones included, null block excluded
    counters: SchedulerCounters = field(default_factory=SchedulerCounters)
    # Private columns (see module docstring); never mutated once the state exists.
    _static: Mapping[str, Request] = _EMPTY  # as added, with status/preemptions/spec kept current
    _computed: Mapping[str, int] = _EMPTY  # num_computed_tokens
    _tables: Mapping[str, tuple[int, ...]] = _EMPTY  # block table of each request holding blocks
    _num_cached: Mapping[str, int] = _EMPTY  # leading blocks of each table in the prefix cache
    # With several KV cache groups (docs §13): the tables of groups 1.., keyed as _tables
    _more_tables: Mapping[str, tuple[tuple[int, ...], ...]] = _EMPTY
    _placeholders: Mapping[str, int] = _EMPTY  # async: tokens owed by steps in flight, one per
    # step that samples the request (one verifying drafts may give it more: docs §4.1)
    _finished: frozenset[str] = frozenset()  # reported by the next schedule()
    _served: Mapping[str | None, int] = _EMPTY  # tokens served to finished requests, by
    # metadata["tenant"] (None: no tenant), for fair-share policies (docs/SCHEDULING.md §8)
    _kv_transfers: KVTransfers = NO_TRANSFERS  # loads done, held blocks, saves to report (§11)
    _data: Version  # of a StateData: the KV pool and token histories at this state

    __hash__ = None  # equality is by content (below), and a state is not meant as a key

    def __eq__(self, other: object) -> bool:
        """States are equal when they hold the same content: configuration, step, queues,
        counters, every request with its tokens and progress, block tables, the ids still to
        report as finished, and the KV pool (free queue, reference counts, prefix cache)."""
        if not isinstance(other, SchedulerState):
            return NotImplemented
        return self is other or self._content() == other._content()

    def _content(self) -> tuple:
        # The shared data is copied out under its lock: reading `other` next may reroot it.
        return (self.config, self.step, self.waiting, self.running, self.num_free_blocks,
                self.counters, self._static, self._computed, self._tables, self._more_tables,
                self._num_cached,
                self._placeholders, self._finished, self._served, self._kv_transfers,
                self._data.read(StateData.content))

    @property
    def requests(self) -> Mapping[str, Request]:
        """Every unfinished request, with its progress fields filled in."""
        return RequestsView(self)

    def num_prompt_tokens(self, request_id: str) -> int:
        """The prompt length of an unfinished request, without building its `Request`."""
        return len(self._static[request_id].prompt_token_ids)

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """The KV block ids of a request in KV cache group 0 (empty while it holds none)."""
        return self._tables.get(request_id, ())

    def group_block_tables(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """The request's block table in each KV cache group, in the order of
        `config.kv_cache_groups` (empty ones while it holds none); a sliding group's has the
        null block 0 where its window has moved past (docs/SCHEDULING.md §13)."""
        n = len(self.config.kv_cache_groups)
        if request_id not in self._tables:
            return ((),) * n
        return (self._tables[request_id],) + self._more_tables.get(request_id, ())

    # The columns, for checkers and tools that must not build whole `Request`s per step: each
    # mapping is the state's own read-only one, keyed by request id, returned without a copy.

    def status(self, request_id: str) -> RequestStatus:
        """The status of an unfinished request, without building its `Request`."""
        return self._static[request_id].status

    def spec_token_ids(self, request_id: str) -> tuple[int, ...]:
        """The draft tokens an unfinished request has yet to verify."""
        return self._static[request_id].spec_token_ids

    @property
    def num_computed_tokens(self) -> Mapping[str, int]:
        """Tokens whose KV is computed (or loaded by a KV connector), per unfinished request."""
        return self._computed

    @property
    def block_tables(self) -> Mapping[str, tuple[int, ...]]:
        """The block table of each request that holds blocks: every running one, and a waiting
        one a KV connector loads (or has loaded) KV for (docs/SCHEDULING.md §11)."""
        return self._tables

    @property
    def num_cached_blocks(self) -> Mapping[str, int]:
        """Per request in `block_tables`: its leading blocks registered in the prefix cache."""
        return self._num_cached

    @property
    def num_output_placeholders(self) -> Mapping[str, int]:
        """Async scheduling: the tokens owed to a request by steps in flight (absent: none)."""
        return self._placeholders

    @property
    def finished_served(self) -> Mapping[str | None, int]:
        """Tokens served to finished requests, by `metadata["tenant"]` (None: no tenant)."""
        return self._served

    @property
    def kv_transfers(self) -> KVTransfers:
        """A KV connector's bookkeeping (docs/SCHEDULING.md §11): loads done but not yet
        taken up, blocks finished requests still hold, saves the next plan reports."""
        return self._kv_transfers

    def read_data[T](self, read: Callable[["StateData"], T]) -> T:
        """`read(data)` of this state's `StateData` (its KV pool and token histories), under
        the lock of its lineage. `read` must only read, and keep nothing of `data`: the
        lineage's other states share it, and editing one of them changes it."""
        return self._data.read(read)

    @property
    def held_req_ids(self) -> frozenset[str]:
        """Finished requests whose blocks a KV connector still holds (a save, or a load it
        cannot cancel, is running: docs/SCHEDULING.md §11); freed as the worker reports them."""
        return frozenset(self._kv_transfers.held)

    def free_block_queue(self) -> tuple[int, ...]:
        """The free queue, head (next allocated) first; cached free blocks sit at the tail."""
        return self._data.read(lambda d: tuple(d.kv.free_list()))

    @property
    def stats(self) -> SchedulerStats:
        usable = self.config.num_blocks - 1
        used = usable - self.num_free_blocks
        return SchedulerStats(
            **{name: getattr(self.counters, name) for name in SchedulerCounters.__slots__},
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=used / usable if usable else 0.0,
        )


class StateData:
    """The large, mutable part of a lineage of states, shared through a `Version`.

    Changed only through the journal of an open edit (`scheduler/core/_work.py`), so that every
    version sees exactly its own content."""

    __slots__ = ("kv", "tokens")

    def __init__(self, num_blocks: int) -> None:
        self.kv = PoolData(num_blocks)  # blocks, free queue, prefix cache
        self.tokens: dict[str, list[int]] = {}  # request id -> prompt + output token ids

    def content(self) -> tuple:
        """What this data holds, as immutable values (see `PoolData.content`)."""
        return {r: tuple(t) for r, t in self.tokens.items()}, self.kv.content()


class RequestsView(Mapping[str, Request]):
    """Read-only mapping id -> `Request` with progress fields, built on access."""

    __slots__ = ("_s",)

    def __init__(self, state: SchedulerState) -> None:
        self._s = state

    def __getitem__(self, rid: str) -> Request:
        s = self._s
        static = s._static[rid]
        start = len(static.prompt_token_ids)
        return dataclasses.replace(
            static,
            output_token_ids=s._data.read(lambda d: tuple(d.tokens[rid][start:])),
            num_computed_tokens=s._computed[rid],
            num_output_placeholders=s._placeholders.get(rid, 0),
        )

    def __contains__(self, rid: object) -> bool:
        return rid in self._s._static  # without building the Request

    def __iter__(self) -> Iterator[str]:
        return iter(self._s._static)

    def __len__(self) -> int:
        return len(self._s._static)


def init_state(config: SchedulerConfig) -> SchedulerState:
    """The empty state: no requests, every usable block free."""
    return SchedulerState(
        config=config, num_free_blocks=config.num_blocks - 1,
        _data=Version.initial(StateData(config.num_blocks)),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class NewRequestData:
    """A request scheduled for the first time (a resumed preempted request is not one)."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    block_ids: tuple[int, ...]  # its whole block table
    num_computed_tokens: int  # prefix-cache hit: tokens it does not compute


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerOutput:
    """The plan of one step: everything a model runner needs to build its device batch."""

    num_scheduled_tokens: Mapping[str, int]  # in scheduling order: running, then admitted
    total_num_scheduled_tokens: int
    num_computed_tokens: Mapping[str, int]  # per scheduled request, before this step
    input_token_ids: Mapping[str, tuple[int, ...]]  # the tokens each request computes now;
    # under async scheduling a decode's one token may be PLACEHOLDER_TOKEN_ID (sampled by the
    # step in flight, which the runner knows)
    block_tables: Mapping[str, tuple[int, ...]]  # after this step's allocation (group 0)
    sampling_req_ids: tuple[str, ...]  # requests whose prompt is complete: they sample
    scheduled_new_reqs: tuple[NewRequestData, ...]  # admitted for the first time
    scheduled_spec_decode_tokens: Mapping[str, tuple[int, ...]]
    preempted_req_ids: frozenset[str]
    finished_req_ids: frozenset[str]  # finished since the previous step (free their state)
    # What a KV connector's worker side must do this step (docs/SCHEDULING.md §11); None when
    # schedule() was given no connector
    kv_connector_metadata: KVConnectorMetadata | None = None
    # Per KV cache group (config.kv_cache_groups), each scheduled request's block table after
    # this step's allocation; group 0's is `block_tables` (docs/SCHEDULING.md §13)
    group_block_tables: tuple[Mapping[str, tuple[int, ...]], ...]


class RequestDelta(NamedTuple):
    """What one step added to a request (a NamedTuple: one is built per request per step)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None  # None, "stop", "length" or "abort"
    stop_reason: int | str | None  # the stop token id or stop string that finished it, if any
