"""The scheduler's bookkeeping of KV transfers (docs/SCHEDULING.md §11), on a `Work`.

`KVTransfers` is the frozen part of a state that a KV connector adds: the asynchronous loads
reported finished but not yet taken up, the blocks that finished requests still hold for the
connector, and the saves the next plan reports. Without a connector it stays `NO_TRANSFERS`,
and no function here runs. The functions below are called by `schedule.py` (asking the
connector, visiting block holders first, taking up a finished load), `_work.py` (holding a
finished request's blocks) and `update.py` (applying a `KVConnectorOutput`); each replaces
`w.kvt` rather than changing it.
"""

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from scheduler.config import SchedulerConfig
from scheduler.kv.groups import one_full_group
from scheduler.kv_connector import KVConnector, KVConnectorOutput, KVSave
from scheduler.request import RequestStatus

if TYPE_CHECKING:
    from scheduler.core._work import Work

RECV, SEND = "recv", "send"  # why a finished request's blocks are held


@dataclass(frozen=True, slots=True)
class Held:
    """The blocks of a finished request that a transfer still uses."""

    block_ids: tuple[int, ...]
    pending: frozenset[str]  # RECV: a load into them is still running; SEND: a save


@dataclass(frozen=True, slots=True, kw_only=True)
class KVTransfers:
    """KV-transfer bookkeeping of one state (immutable)."""

    recved: frozenset[str] = frozenset()  # WAITING_FOR_REMOTE_KVS requests whose load is done
    held: Mapping[str, Held] = field(default_factory=lambda: MappingProxyType({}))
    saves: tuple[KVSave, ...] = ()  # reported by the next schedule() given a connector


NO_TRANSFERS = KVTransfers()


def take_up_load(w: "Work", rid: str) -> bool:
    """A WAITING_FOR_REMOTE_KVS request at the head of `waiting`: if its load was reported
    finished, make it schedulable again (WAITING, or PREEMPTED if it had been) with
    `num_computed_tokens` the loaded prefix, register its loaded full blocks in the prefix
    cache, and return True; else return False (it stays skipped).

    As vLLM's `_update_waiting_for_remote_kv`: a prefix covering every token recomputes the
    last one (the step must produce logits); a load that failed from its first block
    (`num_computed_tokens` truncated to 0) frees the blocks, so admission starts afresh."""
    kvt = w.kvt
    if rid not in kvt.recved:
        return False
    w.kvt = dataclasses.replace(kvt, recved=kvt.recved - {rid})
    computed = w.computed[rid]
    if computed == 0:
        w.free_blocks(rid)
    else:
        num_tokens = len(w.tokens[rid])
        if computed >= num_tokens:
            computed = w.computed[rid] = num_tokens - 1
        w.allocate(rid, computed)  # the table covers it: this only registers full blocks
    req = w.static[rid]
    w.update(rid, status=RequestStatus.PREEMPTED if req.num_preemptions
             else RequestStatus.WAITING)
    return True


def require_one_group(config: SchedulerConfig) -> None:
    """Raise ValueError unless the model has one full-attention KV cache group: a connector's
    loads and saves are block lists of one table (docs/SCHEDULING.md §13)."""
    if not one_full_group(config.kv_cache_groups):
        raise ValueError(
            f"kv_cache_groups={config.kv_cache_groups!r}: a KV connector (KV offloading) "
            "works only with one full-attention KV cache group; serve this model without one")


def hold_blocks(w: "Work", rid: str, pending: frozenset[str]) -> None:
    """A finishing request's blocks stay allocated for a transfer (vLLM's delay_free_blocks);
    with SEND the next plan lists a `KVSave` of them. Call before its hashes are forgotten."""
    table = w.tables.pop(rid)
    del w.num_cached[rid]
    kvt = w.kvt
    held = dict(kvt.held)
    held[rid] = Held(table, pending)
    saves = kvt.saves
    if SEND in pending:
        computed = w.computed[rid]
        tokens = w.tokens[rid]
        req = w.static[rid]
        hashes = w.kv.block_hashes(rid, tokens, computed // w.config.block_size,
                                   req.cache_salt, req.lora_name)
        saves += (KVSave(req_id=rid, block_ids=table, token_ids=tuple(tokens[:computed]),
                         block_hashes=hashes),)
    w.kvt = dataclasses.replace(kvt, held=MappingProxyType(held), saves=saves)


def apply_output(w: "Work", out: KVConnectorOutput) -> None:
    """Apply what the worker side reports (vLLM's `_handle_invalid_blocks` for asynchronous
    loads, then `_update_from_kv_xfer_finished`). Unknown or already settled ids are ignored.

    - `invalid_block_ids`: each WAITING_FOR_REMOTE_KVS request whose loaded range holds one
      keeps only the blocks before the first (its `num_computed_tokens` is truncated there);
      the rest is recomputed once the load is reported finished. A block of no asynchronous
      load in progress raises ValueError (synchronous loads cannot fail).
    - `finished_recving`: a waiting request may be taken up by the next schedule(); a finished
      one releases the blocks it held for the load.
    - `finished_sending`: the blocks held for the save are released."""
    if out.invalid_block_ids:
        _truncate_failed_loads(w, out.invalid_block_ids)
    kvt = w.kvt
    recved = set(kvt.recved)
    held = dict(kvt.held)
    for reason, ids in ((RECV, out.finished_recving), (SEND, out.finished_sending)):
        for rid in ids:
            if reason == RECV and rid in w.static:
                if w.static[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    recved.add(rid)
            elif rid in held and reason in held[rid].pending:
                left = held[rid].pending - {reason}
                if left:
                    held[rid] = Held(held[rid].block_ids, left)
                else:
                    w.kv.free(held.pop(rid).block_ids)
    w.kvt = dataclasses.replace(kvt, recved=frozenset(recved), held=MappingProxyType(held))


def _truncate_failed_loads(w: "Work", invalid: frozenset[int]) -> None:
    bs = w.config.block_size
    loading: set[int] = set()  # blocks of requests loading asynchronously
    for rid in w.waiting:
        if w.static[rid].status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            continue
        loading.update(w.tables[rid])
        computed = w.computed[rid]
        for i, block in enumerate(w.tables[rid][:-(-computed // bs)]):
            if block in invalid:
                w.computed[rid] = i * bs
                break
    for held in w.kvt.held.values():
        if RECV in held.pending:  # aborted while loading: its blocks are freed anyway
            loading.update(held.block_ids)
    if not invalid <= loading:
        raise ValueError(
            f"KV connector output: invalid_block_ids {sorted(invalid - loading)} are not "
            "blocks of an asynchronous load in progress; only those can fail (a synchronous "
            "load must succeed: answer load_async=True for a load that may fail)")


def ask_connector(w: "Work", connector: KVConnector, rid: str, num_hit: int,
                  num_tokens: int) -> tuple[int, bool] | None:
    """The connector's (tokens, load_async) for a request being admitted, checked; None when
    it does not know yet.

    Raises:
        ValueError: tokens not an int in [0, num_tokens - num_hit], or an asynchronous load
            of 0 tokens (the message names the connector and the request)."""
    num_external, load_async = connector.get_num_new_matched_tokens(w.views[rid], num_hit)
    if num_external is None:
        return None
    name = type(connector).__name__
    if (not isinstance(num_external, int) or isinstance(num_external, bool)
            or not 0 <= num_external <= num_tokens - num_hit):
        raise ValueError(
            f"KV connector {name}: get_num_new_matched_tokens({rid!r}, {num_hit}) returned "
            f"{num_external!r} tokens; return an int in [0, {num_tokens - num_hit}] (the "
            f"request has {num_tokens} tokens, {num_hit} of them in the local prefix cache)")
    if load_async and not num_external:
        raise ValueError(f"KV connector {name}: get_num_new_matched_tokens({rid!r}) asked for "
                         "an asynchronous load of 0 tokens; return (0, False) instead")
    return num_external, bool(load_async)


def holders_first(w: "Work") -> dict[str, int]:
    """Visit the waiting requests that hold blocks (KV loaded or loading) first this step, as
    vLLM serves its `skipped_waiting` queue first: the blocks they hold cannot stall the others
    for good. Returns the policy's order, to restore."""
    order = {rid: i for i, rid in enumerate(w.waiting)}
    tables = w.tables
    w.waiting.sort(key=lambda rid: rid not in tables)  # stable
    return order
