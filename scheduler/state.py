"""The scheduler's values: `SchedulerState` (frozen), the plan of one step, and result deltas.

Inside, per-request progress is kept as columns (dicts keyed by request id) that each pure
function copies before changing; token histories are append-only lists shared between versions
(a version reads only the first `num_tokens` entries; appending past another version's end
copies first); the KV pool is a `_versioned.Version`. `state.requests` rebuilds public `Request`
values from these on access.
"""

import ast
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from scheduler._versioned import Version
from scheduler.config import SchedulerConfig
from scheduler.kv_cache import PoolData
from scheduler.request import Request, SamplingParams

_EMPTY: Mapping = MappingProxyType({})


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerCounters:
    """Cumulative counters (prefix-cache lookups are counted per admission)."""

    prefix_cache_queries: int = 0  # tokens looked up at first admissions
    prefix_cache_hits: int = 0  # of those, tokens found cached
    preempted_prefix_cache_queries: int = 0  # the same for re-admissions after preemption
    preempted_prefix_cache_hits: int = 0
    num_preemptions: int = 0  # preemptions so far


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
    _num_tokens: Mapping[str, int] = _EMPTY  # prompt + output length
    _tokens: Mapping[str, list[int]] = _EMPTY  # shared append-only token histories
    _tables: Mapping[str, tuple[int, ...]] = _EMPTY  # block table of each request holding blocks
    _num_cached: Mapping[str, int] = _EMPTY  # leading blocks of each table in the prefix cache
    _finished: frozenset[str] = frozenset()  # reported by the next schedule()
    _pool: Version  # the KV block pool at this state

    @property
    def requests(self) -> Mapping[str, Request]:
        """Every unfinished request, with its progress fields filled in."""
        return RequestsView(self)

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """The KV block ids of a request (empty while it holds none)."""
        return self._tables.get(request_id, ())

    def free_block_queue(self) -> tuple[int, ...]:
        """The free queue, head (next allocated) first; cached free blocks sit at the tail."""
        return self._pool.read(lambda d: tuple(d.free_list()))

    @property
    def stats(self) -> SchedulerStats:
        usable = self.config.num_blocks - 1
        used = usable - self.num_free_blocks
        return SchedulerStats(
            **{f.name: getattr(self.counters, f.name)
               for f in dataclasses.fields(SchedulerCounters)},
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=used / usable if usable else 0.0,
        )

    def __reduce__(self):
        # Pickle the logical content: the pool as this version sees it, dicts in sorted order,
        # so equal states pickle to equal bytes whatever edits happened to other versions.
        plain = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        plain["_pool"] = self._pool.read(_canonical_pool)
        for name in ("_static", "_computed", "_num_tokens", "_tables", "_num_cached"):
            plain[name] = dict(sorted(plain[name].items()))
        plain["_tokens"] = {r: plain["_tokens"][r][: self._num_tokens[r]]
                           for r in sorted(plain["_tokens"])}
        plain["_finished"] = tuple(sorted(plain["_finished"]))
        return (_unpickle_state, (plain,))


def _canonical_pool(d: PoolData) -> str:
    # A literal, not a pickle: pickle memoizes objects by identity, and rerooting may leave equal
    # but distinct hash objects where there was one, which would change the bytes, not the state.
    state = dict(vars(d))
    for name, value in state.items():
        if isinstance(value, dict):
            state[name] = sorted(value.items())
    return repr(state)


def _unpickle_state(plain: dict) -> SchedulerState:
    data = PoolData.__new__(PoolData)
    for name, value in ast.literal_eval(plain["_pool"]).items():
        setattr(data, name, dict(value) if name in _POOL_DICTS else value)
    plain = plain | {
        "_pool": Version.initial(data),
        "_finished": frozenset(plain["_finished"]),
        "_static": MappingProxyType(plain["_static"]),
        "_computed": MappingProxyType(plain["_computed"]),
        "_num_tokens": MappingProxyType(plain["_num_tokens"]),
        "_tokens": MappingProxyType(plain["_tokens"]),
        "_tables": MappingProxyType(plain["_tables"]),
        "_num_cached": MappingProxyType(plain["_num_cached"]),
    }
    return SchedulerState(**plain)


_POOL_DICTS = ("cached", "req_hashes")


class RequestsView(Mapping[str, Request]):
    """Read-only mapping id -> `Request` with progress fields, built on access."""

    __slots__ = ("_s",)

    def __init__(self, state: SchedulerState) -> None:
        self._s = state

    def __getitem__(self, rid: str) -> Request:
        s = self._s
        static = s._static[rid]
        n = s._num_tokens[rid]
        return dataclasses.replace(
            static,
            output_token_ids=tuple(s._tokens[rid][len(static.prompt_token_ids):n]),
            num_computed_tokens=s._computed[rid],
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._s._static)

    def __len__(self) -> int:
        return len(self._s._static)


def init_state(config: SchedulerConfig) -> SchedulerState:
    """The empty state: no requests, every usable block free."""
    return SchedulerState(
        config=config, num_free_blocks=config.num_blocks - 1,
        _pool=Version.initial(PoolData(config.num_blocks)),
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
    input_token_ids: Mapping[str, tuple[int, ...]]  # the tokens each request computes now
    block_tables: Mapping[str, tuple[int, ...]]  # after this step's allocation
    sampling_req_ids: tuple[str, ...]  # requests whose prompt is complete: they sample
    scheduled_new_reqs: tuple[NewRequestData, ...]  # admitted for the first time
    scheduled_spec_decode_tokens: Mapping[str, tuple[int, ...]]
    preempted_req_ids: frozenset[str]
    finished_req_ids: frozenset[str]  # finished since the previous step (free their state)


class RequestDelta(NamedTuple):
    """What one step added to a request (a NamedTuple: one is built per request per step)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None  # None, "stop", "length" or "abort"
    stop_reason: int | str | None  # the stop token id that finished it, if any
