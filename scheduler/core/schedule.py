"""`schedule()`: one step of vLLM V1's scheduler as a pure function (docs/SCHEDULING.md §3).

There is no prefill phase and no decode phase. Every request has `num_tokens` (prompt + outputs)
and `num_computed_tokens`; each step hands out a token budget so that each request's computed
count catches up with its token count. The same code covers prefills, chunked prefills, decodes,
prefix-cache hits, resumed preemptions and speculative drafts.
"""

import dataclasses
from types import MappingProxyType

from scheduler.core import kv_transfer
from scheduler.core._work import Work
from scheduler.core.partial_prefill import PartialPrefills
from scheduler.core.state import (
    PLACEHOLDER_TOKEN_ID,
    NewRequestData,
    SchedulerOutput,
    SchedulerState,
)
from scheduler.kv.kv_cache import Hit
from scheduler.kv_connector import KVConnector, KVConnectorMetadata, KVLoad
from scheduler.request import Request, RequestStatus


class _Step:
    """What one schedule() call has decided so far."""

    def __init__(self, w: Work, connector: KVConnector | None) -> None:
        cfg = w.config
        self.budget: int = cfg.max_num_scheduled_tokens
        # The long-prefill cap protects other requests; with one request there is nobody.
        many = len(w.running) + len(w.waiting) > 1
        self.threshold: int = cfg.long_prefill_token_threshold if many else 0
        self.tokens: dict[str, int] = {}  # request -> tokens scheduled, in scheduling order
        self.computed_before: dict[str, int] = {}
        self.inputs: dict[str, tuple[int, ...]] = {}  # the token ids each request computes
        self.tables: dict[str, tuple[int, ...]] = {}  # block tables after allocation
        self.sampling: dict[str, None] = {}  # requests that sample, as an ordered set
        self.spec: dict[str, tuple[int, ...]] = {}
        self.new: list[str] = []  # admitted from waiting for the first time
        self.preempted: list[str] = []
        self.prefills: PartialPrefills | None = None
        self.connector = connector  # its answers are this step's input (docs §11)
        self.loads: list[KVLoad] = []
        self.evicted: list = []  # filled by the KV pool while a connector is given
        # Distinct LoRA adapters a step may serve (docs §14); 0: LoRA off, nothing to count
        self.max_loras: int = cfg.max_loras or 0
        self.loras: dict[int, int] = {}  # adapter id -> scheduled requests with it
        self.lora_of: dict[str, int] = {}  # scheduled request -> its adapter id
        if cfg.max_num_partial_prefills > 1:
            self.prefills = PartialPrefills.for_step(
                max_prefills=cfg.max_num_partial_prefills,
                max_long=cfg.max_long_partial_prefills, threshold=self.threshold,
                batched_tokens=cfg.max_num_batched_tokens, running=w.running, waiting=w.waiting,
                remaining=lambda r: len(w.tokens[r]) - w.computed[r],
            )

    def lora_blocked(self, req: Request) -> bool:
        """Would the request's adapter make more than `max_loras` distinct adapters in this
        step? (Only asked with LoRA on.)"""
        lora = req.lora_request
        return (lora is not None and lora.lora_int_id not in self.loras
                and len(self.loras) >= self.max_loras)

    def add_lora(self, rid: str, req: Request) -> None:
        """Count a scheduled request's adapter among the step's (only called with LoRA on)."""
        if req.lora_request is not None:
            lora = self.lora_of[rid] = req.lora_request.lora_int_id
            self.loras[lora] = self.loras.get(lora, 0) + 1

    def cap_long(self, n: int) -> int:
        """The long-prefill threshold's cap."""
        return self.threshold if 0 < self.threshold < n else n

    def record(self, w: Work, rid: str, n: int, computed: int) -> None:
        """Schedule n tokens of the request, whose first `computed` tokens have KV."""
        self.tokens[rid] = n
        self.computed_before[rid] = computed
        self.budget -= n
        end = computed + n
        history = w.tokens[rid]
        num_tokens = len(history)
        if n == 1 and end <= num_tokens:  # a decode: the one token sampled last step
            self.inputs[rid] = (history[computed],)
        else:  # with the placeholders and drafts past the known tokens
            self.inputs[rid] = w.token_ids(rid, computed, end)
        self.tables[rid] = w.tables[rid]
        if end >= num_tokens + w.placeholders.get(rid, 0):
            self.sampling[rid] = None
        if self.max_loras:
            self.add_lora(rid, w.static[rid])

    def unschedule(self, rid: str) -> None:
        """A scheduled request was preempted: give its tokens back."""
        self.budget += self.tokens.pop(rid)
        for planned in (self.computed_before, self.inputs, self.tables):
            del planned[rid]
        for planned in (self.sampling, self.spec):
            planned.pop(rid, None)
        lora = self.lora_of.pop(rid, None)
        if lora is not None:
            self.loras[lora] -= 1
            if not self.loras[lora]:
                del self.loras[lora]


def schedule(state: SchedulerState, kv_connector: KVConnector | None = None,
             ) -> tuple[SchedulerState, SchedulerOutput]:
    """Decide which requests run in the next model step and how many tokens each computes.

    Args:
        state: the state to plan from; it is unchanged and can be scheduled again.
        kv_connector: a KV connector's answers for this step (docs/SCHEDULING.md §11): how
            many tokens past the local prefix hit it can load for a waiting request. Given,
            the plan's `kv_connector_metadata` says what its worker side must do.
    Returns:
        The new state (computed counters advanced at schedule time) and the plan.
    """
    if kv_connector is not None:
        kv_transfer.require_one_group(state.config)
    w = Work(state)
    try:
        if w.policy.dynamic:  # keys may have changed since the last step (docs §8)
            w.policy.reorder(w.waiting, w.views)
        st = _Step(w, kv_connector)
        if kv_connector is not None:
            w.kv.evicted = st.evicted
        _schedule_running(w, st)
        if not st.preempted:  # a step that had to preempt admits nobody
            _schedule_waiting(w, st)
        plan = _make_output(w, st, state)
        for rid, n in st.tokens.items():
            w.computed[rid] += n  # advance at schedule time
        if w.config.async_scheduling:  # each sampler's token is owed until its update
            for rid in st.sampling:
                w.placeholders[rid] = w.placeholders.get(rid, 0) + 1
        w.finished = set()
    except BaseException:
        w.abort()
        raise
    return w.freeze(step=state.step + 1), plan


def _schedule_running(w: Work, st: _Step) -> None:
    # The hot loop of every step, one iteration per running request: columns are bound to
    # locals; a plain decode whose slot is already allocated takes a short exact path (n = 1
    # passes every cap), and a request whose tokens fit in its blocks skips Work.allocate.
    running, computed_of, static = w.running, w.computed, w.static
    tables, num_cached, histories = w.tables, w.num_cached, w.tokens
    placeholders = w.placeholders  # empty unless async scheduling has a step in flight
    bs, caching = w.config.block_size, w.config.enable_prefix_caching
    hybrid = w.kv.hybrid  # windows slide at every step's allocation (docs §13)
    last_position = w.config.max_model_len - 1
    threshold, prefills, max_loras = st.threshold, st.prefills, st.max_loras
    planned, before, inputs, sampling = st.tokens, st.computed_before, st.inputs, st.sampling
    i = 0
    while i < len(running) and st.budget > 0:
        rid = running[i]
        computed = computed_of[rid]
        table = tables[rid]
        history = histories[rid]
        known = len(history)  # tokens whose ids are known
        ph = placeholders.get(rid, 0) if placeholders else 0
        # A step in flight verifies its drafts (computed counts them, past its owed tokens:
        # how many it keeps is unknown until that update), or surely ends it (as vLLM): it
        # sits this step out.
        if ph and (computed >= known + ph
                   or _finishes_in_flight(static[rid], known + ph, last_position)):
            i += 1
            continue
        # vLLM asserts this never happens; here a request that sat a step out may have let a
        # new adapter in (docs §14): it waits, keeping its blocks and place, never preempting.
        if max_loras and st.lora_blocked(static[rid]):
            i += 1
            continue
        num_tokens = known + ph
        if (num_tokens - computed == 1 and computed < len(table) * bs and not hybrid
                and not (caching and (computed + 1 - ph) // bs > num_cached[rid])
                and not static[rid].spec_token_ids):
            planned[rid] = 1
            before[rid] = computed
            inputs[rid] = (PLACEHOLDER_TOKEN_ID,) if ph else (history[computed],)
            st.tables[rid] = table
            sampling[rid] = None
            st.budget -= 1
            if max_loras:
                st.add_lora(rid, static[rid])
            i += 1
            continue
        spec = static[rid].spec_token_ids
        n = num_tokens + len(spec) - computed
        if 0 < threshold < n:
            n = threshold
        n = min(n, st.budget, last_position - computed)
        if prefills is not None:
            n, _ = prefills.limit(num_tokens - computed, n)
        if n <= 0:
            i += 1
            continue
        end = computed + n
        fits = end <= len(table) * bs and not hybrid and not (
            caching and min(end, known) // bs > num_cached[rid])
        ok = fits
        if not fits:
            ok, shift = _allocate_or_preempt(w, st, rid, end, i)
            i -= shift  # victims ahead of the request moved it up
        if ok:
            st.record(w, rid, n, computed)
            if spec:
                _take_spec(st, rid, spec, num_tokens, end)
            if prefills is not None:
                prefills.record(num_tokens - computed)
            i += 1
        else:
            # The request preempted itself: the RUNNING pass ends under every policy (vLLM
            # `break`s), so requests after it in `running` get nothing this step.
            break


def _finishes_in_flight(req: Request, num_tokens: int, last_position: int) -> bool:
    """Will the request surely finish by length once its tokens in flight arrive (it then has
    `num_tokens`)? Then async scheduling plans no step for it."""
    max_tokens = req.sampling_params.max_tokens
    return num_tokens > last_position or (
        max_tokens is not None and num_tokens - len(req.prompt_token_ids) >= max_tokens)


def _allocate_or_preempt(w: Work, st: _Step, rid: str, num_slots: int,
                         index: int) -> tuple[bool, int]:
    """Allocate for the request at `running[index]`, preempting the policy's victims until it
    fits. Returns (allocated: False if the request itself was preempted, how many victims
    stood ahead of it)."""
    ahead = 0
    while not w.allocate(rid, num_slots):
        victim = w.policy.victim(w.running, w.views)
        if w.running.index(victim) < index - ahead:
            ahead += 1
        if victim in st.tokens:
            st.unschedule(victim)
        w.preempt(victim)
        st.preempted.append(victim)
        if victim == rid:
            return False, ahead
    return True, ahead


def _take_spec(st: _Step, rid: str, spec: tuple[int, ...], num_tokens: int, end: int) -> None:
    """Record the drafts the request's scheduled tokens reach: those past its `num_tokens`
    (known and owed), up to `end`."""
    num_spec = end - num_tokens
    if num_spec > 0:
        st.spec[rid] = spec[:num_spec]


def _schedule_waiting(w: Work, st: _Step) -> None:
    order = None
    if len(w.tables) > len(w.running):  # waiting requests hold KV a connector loads (§11)
        order = kv_transfer.holders_first(w)
    _admit_waiting(w, st)
    if order is not None:  # back to the policy's order
        w.waiting.sort(key=order.__getitem__)


def _admit_waiting(w: Work, st: _Step) -> None:
    cfg = w.config
    skipped: list[str] = []
    placeholders = w.placeholders
    while w.waiting and st.budget > 0 and len(w.running) < cfg.max_num_seqs:
        rid = w.waiting[0]
        if placeholders and placeholders.get(rid):
            # Preempted while a step that samples for it was in flight: it resumes once that
            # token is known (schedule() again before updating is the only way to see this).
            skipped.append(w.waiting.pop(0))
            continue
        num_tokens = len(w.tokens[rid])
        found = _find_computed(w, st, rid, num_tokens)
        if found is None:  # not ready (grammar, KV) or the connector does not know: keeps its place
            skipped.append(w.waiting.pop(0))
            continue
        hit, num_computed, lookup = found
        if num_computed < 0:
            break  # an asynchronous load found the pool short, as any admission
        n = st.cap_long(num_tokens - num_computed)  # a resumed request recomputes its outputs
        if not cfg.enable_chunked_prefill and n > st.budget:
            break  # head-of-line blocking: the prompt may not be split
        n = min(n, st.budget)
        if st.prefills is not None:
            n, why = st.prefills.limit(num_tokens - num_computed, n)
            if why == "long":
                skipped.append(w.waiting.pop(0))  # keeps its place; shorter ones may start
                continue
            if why == "full":
                break
        if cfg.reserve_full_prompt and not _fits_whole(w, rid, num_tokens, hit):
            break
        if not w.allocate(rid, num_computed + n, hit):
            break  # waiting requests never preempt
        w.waiting.pop(0)
        num_hit = len(hit[0]) * cfg.block_size
        if lookup and lookup[1]:  # loaded inside this step, before its forward pass
            st.loads.append(KVLoad(req_id=rid, block_ids=w.tables[rid],
                                   num_computed_tokens=num_hit,
                                   num_external_tokens=num_computed - num_hit,
                                   load_async=False))
        _admit(w, st, rid, n, num_tokens, num_computed, lookup)
    for rid in reversed(skipped):
        w.policy.enqueue(w.waiting, rid, w.views, front=True)


Lookup = tuple[int, int | None]  # (local prefix hit, the connector's tokens or None), counted
_FSM = RequestStatus.WAITING_FOR_FSM


def _find_computed(w: Work, st: _Step, rid: str,
                   num_tokens: int) -> tuple[Hit, int, Lookup | None] | None:
    """Where a waiting request's first tokens' KV comes from: (prefix-cache hit blocks, tokens
    with KV once admitted, the lookup to count; None for a load taken up, counted when it
    started). None: set it aside for this step (its grammar or its KV is not ready, its LoRA
    adapter would exceed `max_loras`, or the connector does not know yet). Tokens -1: stop the
    pass (no blocks)."""
    req = w.static[rid]
    if req.status == _FSM:  # its grammar is still compiling (docs §12)
        return None
    if (req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            and not kv_transfer.take_up_load(w, rid)):
        return None
    if st.max_loras and st.lora_blocked(req):  # vLLM's order: after the two checks above
        return None
    num_computed = w.computed[rid]  # > 0 only once an asynchronous load is taken up
    if num_computed:
        return w.kv.empty, num_computed, None
    # vLLM's skip_reading_prefix_cache (prompt logprobs): its every position is computed
    hit = w.kv.empty if req.skip_reading_prefix_cache else w.kv.find_cached_prefix(
        rid, w.tokens[rid], num_tokens, req.cache_salt, req.lora_name)
    num_hit = len(hit[0]) * w.config.block_size
    if st.connector is None or req.skip_reading_prefix_cache:  # nor external KV (vLLM's
        return hit, num_hit, (num_hit, None)  # connectors answer 0 for such a request)
    match = kv_transfer.ask_connector(w, st.connector, rid, num_hit, num_tokens)
    if match is None:
        return None
    num_external, load_async = match
    if load_async:
        ok = _start_async_load(w, st, rid, hit, num_external, num_tokens)
        return None if ok else (hit, -1, None)
    # Everything loaded: the last token is still computed, for its logits.
    return hit, min(num_hit + num_external, num_tokens - 1), (num_hit, num_external)


def _start_async_load(w: Work, st: _Step, rid: str, hit: Hit, num_external: int,
                      num_tokens: int) -> bool:
    """Allocate blocks for the local hit and the tokens to load, and park the request in
    WAITING_FOR_REMOTE_KVS (vLLM's `load_kv_async`): nothing is computed for it this step, and
    the loaded blocks enter the prefix cache only once the load is reported finished."""
    cfg = w.config
    num_hit = len(hit[0]) * cfg.block_size
    if cfg.reserve_full_prompt and not _fits_whole(w, rid, num_tokens, hit):
        return False
    # Blocks for the whole sequence, not only the loaded part (as vLLM): taking the request
    # up then never waits for blocks, so loads in `waiting` cannot starve each other.
    whole = max(num_hit + num_external, min(num_tokens, cfg.max_model_len))
    if not w.allocate(rid, whole, hit, cache=False):
        return False
    _count_lookup(w, rid, num_tokens, num_hit, num_external)
    w.computed[rid] = num_hit + num_external
    w.update(rid, status=RequestStatus.WAITING_FOR_REMOTE_KVS)
    st.loads.append(KVLoad(req_id=rid, block_ids=w.tables[rid], num_computed_tokens=num_hit,
                           num_external_tokens=num_external, load_async=True))
    return True


def _fits_whole(w: Work, rid: str, num_tokens: int, hit: Hit) -> bool:
    """Are blocks for the whole sequence (plus the watermark, while anything runs) free? A
    sliding group counts only what its window holds at once (docs §13)."""
    cfg = w.config
    tables = w.group_tables(rid)  # a request whose load was taken up holds blocks already
    need = w.kv.num_blocks_needed(tables, min(num_tokens, cfg.max_model_len), hit, whole=True)
    if w.running:
        need += int(cfg.watermark * cfg.num_blocks)
    return need <= w.kv.num_free


def _count_lookup(w: Work, rid: str, num_tokens: int, num_hit: int,
                  num_external: int | None) -> None:
    """Count an admission's prefix-cache lookup (and, with a connector, what it supplied)."""
    req = w.static[rid]
    if not req.skip_reading_prefix_cache:  # vLLM counts no lookup it skips
        prefix = "preempted_" if req.status == RequestStatus.PREEMPTED else ""
        w.counters[prefix + "prefix_cache_queries"] += num_tokens
        w.counters[prefix + "prefix_cache_hits"] += num_hit
    if num_external is not None:
        w.counters["connector_prefix_cache_queries"] += num_tokens - num_hit
        w.counters["connector_prefix_cache_hits"] += num_external


def _admit(w: Work, st: _Step, rid: str, n: int, num_tokens: int, num_computed: int,
           lookup: tuple[int, int | None] | None) -> None:
    req = w.static[rid]
    if lookup is not None:  # None: a taken-up load, counted when it was started
        _count_lookup(w, rid, num_tokens, *lookup)
    if req.status != RequestStatus.PREEMPTED:
        st.new.append(rid)
    w.running.append(rid)
    w.update(rid, status=RequestStatus.RUNNING)
    w.computed[rid] = num_computed
    st.record(w, rid, n, num_computed)
    if st.prefills is not None:
        st.prefills.record(num_tokens - num_computed)


def _make_output(w: Work, st: _Step, state: SchedulerState) -> SchedulerOutput:
    cfg = w.config
    total = sum(st.tokens.values())
    assert total <= cfg.max_num_scheduled_tokens and st.budget >= 0
    assert len(w.running) <= cfg.max_num_seqs
    new_reqs = tuple(
        NewRequestData(req_id=rid, prompt_token_ids=w.static[rid].prompt_token_ids,
                       sampling_params=w.static[rid].sampling_params, block_ids=st.tables[rid],
                       num_computed_tokens=st.computed_before[rid])
        for rid in st.new
    )
    meta = None
    if st.connector is not None:
        meta = KVConnectorMetadata(loads=tuple(st.loads), saves=w.kvt.saves,
                                   evicted_blocks=tuple(st.evicted))
        if w.kvt.saves:
            w.kvt = dataclasses.replace(w.kvt, saves=())
    tables = MappingProxyType(st.tables)
    group_tables: tuple = (tables,)
    if w.kv.hybrid:
        more = w.more_tables
        group_tables += tuple(MappingProxyType({rid: more[rid][g] for rid in st.tables})
                              for g in range(len(cfg.kv_cache_groups) - 1))
    return SchedulerOutput(
        num_scheduled_tokens=MappingProxyType(st.tokens),
        total_num_scheduled_tokens=total,
        num_computed_tokens=MappingProxyType(st.computed_before),
        input_token_ids=MappingProxyType(st.inputs), block_tables=tables,
        group_block_tables=group_tables,
        sampling_req_ids=tuple(st.sampling), scheduled_new_reqs=new_reqs,
        scheduled_spec_decode_tokens=MappingProxyType(st.spec),
        preempted_req_ids=frozenset(st.preempted),
        finished_req_ids=state._finished, kv_connector_metadata=meta,
    )
