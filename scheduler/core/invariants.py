"""`check_invariants(state)`: the bookkeeping rules every state must satisfy (for tests)."""

from collections import Counter

from scheduler.core.state import SchedulerOutput, SchedulerState, StateData
from scheduler.kv.kv_cache import PoolData, cdiv
from scheduler.request import RequestStatus

_UNLOADED = (RequestStatus.WAITING, RequestStatus.WAITING_FOR_FSM, RequestStatus.PREEMPTED)


def check_invariants(state: SchedulerState, output: SchedulerOutput | None = None) -> None:
    """Raise AssertionError naming the first broken rule: queues partition the requests, the
    sequence limit holds, every block is accounted for (reference counts, the free queue, the
    prefix-cache map; blocks held by requests loading KV and by finished requests a KV connector
    still saves, docs/SCHEDULING.md §11), and, given the step's plan, the token budget and
    the LoRA adapter limit (§14) hold."""
    cfg = state.config
    running, waiting = state.running, state.waiting
    assert len(running) <= cfg.max_num_seqs, f"{len(running)} running > max_num_seqs"
    assert len(set(running)) == len(running) and len(set(waiting)) == len(waiting), "duplicates"
    assert set(running) | set(waiting) == set(state.requests), "queues must hold every request"
    assert not set(running) & set(waiting), "a request is both running and waiting"
    for rid in running:
        assert state.status(rid) == RequestStatus.RUNNING, f"{rid} running but not RUNNING"
    for rid in waiting:
        status = state.status(rid)
        # Only KV loaded (or being loaded) by a connector is kept in `waiting`, in blocks held.
        computed = state.num_computed_tokens[rid]
        loaded = status == RequestStatus.WAITING_FOR_REMOTE_KVS or computed > 0
        assert loaded == (rid in state.block_tables), f"waiting {rid}: computed tokens or blocks"
        assert loaded or status in _UNLOADED, rid
        assert not (loaded and status == RequestStatus.WAITING_FOR_FSM), f"{rid}: KV before FSM"
    kvt = state.kv_transfers
    for rid in kvt.recved:
        assert state.status(rid) == RequestStatus.WAITING_FOR_REMOTE_KVS, rid
    assert not set(kvt.held) & set(state.requests), "an unfinished request in held"
    if output is not None:
        total = sum(output.num_scheduled_tokens.values())
        assert total == output.total_num_scheduled_tokens <= cfg.max_num_scheduled_tokens
        if cfg.max_loras:  # off, add_request lets no adapter in
            loras = {r.lora_request.lora_int_id for rid in output.num_scheduled_tokens
                     if (r := state.requests.get(rid)) is not None and r.lora_request}
            assert len(loras) <= cfg.max_loras, f"adapters {sorted(loras)} > max_loras"
    state.read_data(lambda d: _check_data(state, d))


def _check_data(state: SchedulerState, data: StateData) -> None:
    assert set(data.tokens) == set(state.requests), "token histories must follow the requests"
    for rid, computed in state.num_computed_tokens.items():
        spec = state.spec_token_ids(rid)
        owed, known = state.num_output_placeholders.get(rid, 0), len(data.tokens[rid])
        assert computed <= known + len(spec) + owed, f"{rid}: computed past its tokens"
        # Async scheduling: past its owed tokens only by the drafts a step in flight verifies
        assert not owed or computed < known + owed or spec, f"{rid}: computed past owed tokens"
    _check_pool(state, data.kv)


def _check_pool(state: SchedulerState, d: PoolData) -> None:
    cfg = state.config
    bs = cfg.block_size
    holders: Counter[int] = Counter()
    windows = [g.sliding_window for g in cfg.kv_cache_groups]
    for rid in state.block_tables:
        assert rid in state.running or rid in state.waiting, f"finished {rid} holds blocks"
        tables = state.group_block_tables(rid)
        assert len(tables) == len(windows), f"{rid}: a table per KV cache group"
        n = len(tables[0])
        assert n >= cdiv(state.num_computed_tokens[rid], bs), f"{rid}: too few blocks"
        for g, table in enumerate(tables):
            assert len(table) == n, f"{rid}: group {g}'s table is not as long as group 0's"
            # Null entries: none in a full group, a leading run in a sliding one (docs §13)
            live = table.count(0) if windows[g] is not None else 0
            assert 0 not in table[live:], f"{rid} holds the null block in group {g}"
            holders.update(table[live:])
    for rid, held in state.kv_transfers.held.items():
        assert held.pending and 0 not in held.block_ids, f"finished {rid} holds blocks"
        holders.update(held.block_ids)
    for rid in state.running:
        assert rid in state.block_tables, f"running {rid} holds no block table"
    assert set(state.num_cached_blocks) == set(state.block_tables), "num_cached must follow tables"
    assert d.ref[0] == 0, "the null block is referenced"
    for b in range(1, cfg.num_blocks):
        assert d.ref[b] == holders[b], f"block {b}: ref {d.ref[b]} != {holders[b]} holders"
    free = d.free_list()
    assert len(free) == d.num_free == state.num_free_blocks, "free count mismatch"
    assert sorted(free) == [b for b in range(1, cfg.num_blocks) if d.ref[b] == 0], "free queue"
    prev = d.head
    for b in free:
        assert d.prv[b] == prev, f"free queue back link of block {b}"
        prev = b
    for h, blocks in d.cached.items():
        for b in blocks:
            assert d.block_hash[b] == h, f"block {b} registered under a hash it does not hold"
    registered = sum(len(blocks) for blocks in d.cached.values())
    assert registered == sum(h is not None for h in d.block_hash), "stray block hashes"
