"""`Work`: the private, mutable working copy a pure function builds its new state in.

This is where purity lives: `Work(state)` copies the state's small columns and opens an edit of
its `StateData` version (the KV pool and the token histories); the functions in `schedule.py` /
`update.py` then read like vLLM's mutable scheduler; `freeze()` turns the result into a new
frozen `SchedulerState` (or `abort()` undoes the edit when a function raises, leaving the input
state exactly as it was). The edited data is written only through the edit's journal: the KV
pool by `KVCacheManager`, the token histories by the helpers below.
"""

import dataclasses
from types import MappingProxyType

from scheduler.core import kv_transfer
from scheduler.core.state import PLACEHOLDER_TOKEN_ID, SchedulerCounters, SchedulerState, StateData
from scheduler.kv.kv_cache import Hit, KVCacheManager, Table
from scheduler.kv_connector import KVConnector
from scheduler.policies.policies import get_policy
from scheduler.policies.request_view import RequestViews
from scheduler.request import Request, RequestStatus


class Work:
    """Mutable copy of a `SchedulerState` (never escapes the function that made it)."""

    def __init__(self, state: SchedulerState) -> None:
        # Columns are MappingProxyType views; .copy() copies the dict underneath at C speed.
        self.config = cfg = state.config
        self.policy = get_policy(cfg.policy)
        self.waiting: list[str] = list(state.waiting)
        self.running: list[str] = list(state.running)
        self.static: dict[str, Request] = state._static.copy()
        self.computed: dict[str, int] = state._computed.copy()
        self.tables: dict[str, tuple[int, ...]] = state._tables.copy()
        # Groups 1.. of a hybrid model (docs/SCHEDULING.md §13), keyed as `tables`
        self.more_tables: dict[str, tuple[Table, ...]] = state._more_tables.copy()
        self.num_cached: dict[str, int] = state._num_cached.copy()
        self.placeholders: dict[str, int] = state._placeholders.copy()
        self.finished: set[str] = set(state._finished)
        self.served: dict[str | None, int] = state._served.copy()
        self.kvt: kv_transfer.KVTransfers = state._kv_transfers  # replaced, never changed
        self.counters: dict[str, int] = {
            name: getattr(state.counters, name) for name in SchedulerCounters.__slots__}
        self._edit = state._data.edit()
        data: StateData = self._edit.data
        self._journal = self._edit.journal
        # Read freely; change only through add_history / append_token / finish.
        self.tokens: dict[str, list[int]] = data.tokens  # prompt + outputs of each request
        self.kv = KVCacheManager(
            data.kv, self._journal, block_size=cfg.block_size,
            caching=cfg.enable_prefix_caching, max_model_len=cfg.max_model_len,
            groups=cfg.kv_cache_groups,
            step_tokens=cfg.long_prefill_token_threshold or cfg.max_num_scheduled_tokens,
        )

    @property
    def views(self) -> RequestViews:
        """What the policy is shown of each request. Built per call, not kept: a Work that
        held it would be a reference cycle, left for the garbage collector to find."""
        return RequestViews(self)

    def freeze(self, *, step: int) -> SchedulerState:
        """The new state; this Work must not be used afterwards."""
        num_free = self.kv.num_free
        return SchedulerState(
            config=self.config, step=step, waiting=tuple(self.waiting),
            running=tuple(self.running), num_free_blocks=num_free,
            counters=SchedulerCounters(**self.counters),
            _static=MappingProxyType(self.static), _computed=MappingProxyType(self.computed),
            _tables=MappingProxyType(self.tables), _num_cached=MappingProxyType(self.num_cached),
            _more_tables=MappingProxyType(self.more_tables),
            _placeholders=MappingProxyType(self.placeholders),
            _finished=frozenset(self.finished), _served=MappingProxyType(self.served),
            _kv_transfers=self.kvt,
            _data=self._edit.commit(),
        )

    def abort(self) -> None:
        """Undo the edit (the input state stays valid and unchanged)."""
        self._edit.abort()

    # ---- per-request helpers ------------------------------------------------------------

    def token_ids(self, rid: str, start: int, stop: int) -> tuple[int, ...]:
        """Tokens start..stop-1 of prompt + outputs + placeholders (async scheduling: outputs
        the step in flight samples, `PLACEHOLDER_TOKEN_ID`) + draft tokens."""
        history = self.tokens[rid]
        n = len(history)
        if stop <= n:
            return tuple(history[start:stop])
        ahead = ((PLACEHOLDER_TOKEN_ID,) * self.placeholders.get(rid, 0)
                 + self.static[rid].spec_token_ids)
        return tuple(history[start:n]) + ahead[max(0, start - n):stop - n]

    def update(self, rid: str, **changes) -> None:
        """Replace fields of the request's static record (status, preemptions, drafts)."""
        self.static[rid] = dataclasses.replace(self.static[rid], **changes)

    def add_history(self, rid: str, token_ids: list[int]) -> None:
        """Start a new request's token history (prompt + any outputs it arrives with)."""
        self._journal.set_key(self.tokens, rid, token_ids)

    def append_token(self, rid: str, token: int) -> int:
        """Append one output token and return the new token count."""
        history = self.tokens[rid]
        self._journal.append(history, token)
        return len(history)

    def group_tables(self, rid: str) -> tuple[Table, ...]:
        """The request's block table in each KV cache group (empty ones if it holds none)."""
        if not self.kv.hybrid:
            return (self.tables.get(rid, ()),)
        if rid not in self.tables:
            return self.kv.empty
        return (self.tables[rid],) + self.more_tables[rid]

    def _set_tables(self, rid: str, tables: tuple[Table, ...]) -> None:
        self.tables[rid] = tables[0]
        if self.kv.hybrid:
            self.more_tables[rid] = tables[1:]

    def allocate(self, rid: str, num_slots: int, hit: Hit = (), *, cache: bool = True) -> bool:
        """Give the request KV slots for its first `num_slots` tokens (a new request's prefix
        `hit` blocks first, per group) and register its newly full blocks in the prefix cache
        (not with `cache=False`: blocks an asynchronous load has yet to fill). False if the
        pool is short; then nothing changed, except that blocks which slid out of a window
        are freed either way (docs/SCHEDULING.md §13)."""
        kv = self.kv
        if not kv.hybrid:
            tables = (self.tables.get(rid, ()),)
        elif rid in self.tables:  # windows slide before anything is taken (vLLM's order)
            tables = kv.remove_skipped(self.group_tables(rid), self.computed[rid])
            self._set_tables(rid, tables)
        else:
            tables = kv.empty
        bs = self.config.block_size
        if (hit and hit[0]) or num_slots > len(tables[0]) * bs:
            tables = kv.allocate(tables, num_slots, hit)
            if tables is None:
                return False
            self.tables[rid] = tables[0]
            if kv.hybrid:
                self.more_tables[rid] = tables[1:]
            if rid not in self.num_cached:
                self.num_cached[rid] = len(hit[0]) if hit else 0
        if kv.caching and cache:
            num_full = min(num_slots, len(self.tokens[rid])) // bs
            done = self.num_cached[rid]
            if num_full > done:
                req = self.static[rid]
                kv.register(rid, tables, done, num_full, self.tokens[rid], req.cache_salt,
                            req.lora_name)
                self.num_cached[rid] = num_full
        return True

    def free_blocks(self, rid: str) -> None:
        """Release the request's blocks in every group (tail first)."""
        if rid in self.tables:
            self.kv.free_tables(self.group_tables(rid))
            del self.tables[rid], self.num_cached[rid]
            self.more_tables.pop(rid, None)

    def preempt(self, rid: str) -> None:
        """Free the request's blocks and send it to the front of `waiting` to recompute."""
        self.running.remove(rid)
        self.free_blocks(rid)
        req = self.static[rid]
        self.update(rid, status=RequestStatus.PREEMPTED, spec_token_ids=(),
                    num_preemptions=req.num_preemptions + 1)
        self.computed[rid] = 0
        self.counters["num_preemptions"] += 1
        self.policy.enqueue(self.waiting, rid, self.views, front=True)

    def finish(self, rid: str, connector: KVConnector | None = None) -> None:
        """Drop a finished request (the caller removes it from its queue) and free its blocks,
        unless a transfer still uses them (docs/SCHEDULING.md §11): a load not yet reported
        finished, or a save `connector` asks for. What it was served is added to its tenant's
        total."""
        req = self.static[rid]
        served = self.views[rid].num_served_tokens
        if served:
            tenant = req.metadata.get("tenant")
            self.served[tenant] = self.served.get(tenant, 0) + served
        pending = self._pending_transfers(rid, req, connector)
        if pending:
            kv_transfer.hold_blocks(self, rid, pending)
        else:
            self.free_blocks(rid)
        self.kv.forget_hashes(rid)
        self._journal.delete(self.tokens, rid)
        del self.static[rid], self.computed[rid]
        self.placeholders.pop(rid, None)  # a token still in flight for it is dropped
        self.finished.add(rid)

    def _pending_transfers(self, rid: str, req: Request,
                           connector: KVConnector | None) -> frozenset[str]:
        pending = set()
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            if rid in self.kvt.recved:  # loaded, never taken up
                self.kvt = dataclasses.replace(self.kvt, recved=self.kvt.recved - {rid})
            else:  # the worker is still writing into its blocks
                pending.add(kv_transfer.RECV)
        table = self.tables.get(rid)
        if connector is not None and table and connector.request_finished(self.views[rid],
                                                                           table):
            pending.add(kv_transfer.SEND)
        return frozenset(pending)
