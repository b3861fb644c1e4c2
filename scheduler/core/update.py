"""Pure functions that change requests: `add_request`, `abort_requests`, `grammars_ready`,
`update_from_output`."""

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from scheduler._versioned import Version
from scheduler.core import kv_transfer
from scheduler.core._work import Work
from scheduler.core.state import RequestDelta, SchedulerOutput, SchedulerState, StateData
from scheduler.kv_connector import KVConnector, KVConnectorOutput
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams

_FSM = RequestStatus.WAITING_FOR_FSM


def add_request(state: SchedulerState, request: Request) -> SchedulerState:
    """A new state with `request` queued in `waiting` (in policy order).

    Raises:
        ValueError: duplicate id, empty prompt, a prompt of max_model_len tokens or more
            (no room for a single output token), or a LoRA adapter while `max_loras` is off
            (docs/SCHEDULING.md §14). The input state is unchanged.
    """
    rid, prompt = request.request_id, request.prompt_token_ids
    max_len = state.config.max_model_len
    if rid in state._static:
        raise ValueError(f"request {rid!r}: this id is already in use by an unfinished "
                         "request; give each live request its own id")
    if not prompt:
        raise ValueError(f"request {rid!r}: the prompt is empty; give at least one token")
    if len(prompt) >= max_len:
        raise ValueError(
            f"request {rid!r}: prompt of {len(prompt)} tokens leaves no room for output with "
            f"max_model_len={max_len}; shorten the prompt below {max_len} tokens"
        )
    if request.lora_request is not None and not state.config.max_loras:
        raise ValueError(
            f"request {rid!r}: lora_request={request.lora_request!r} but LoRA is off "
            f"(max_loras={state.config.max_loras}); set max_loras >= 1 to serve adapters"
        )
    w = Work(state)
    try:
        history = list(prompt) + list(request.output_token_ids)
        w.static[rid] = dataclasses.replace(
            request,
            output_token_ids=(), spec_token_ids=(), num_computed_tokens=0,
            status=_FSM if request.use_structured_output else RequestStatus.WAITING,
            stop_reason=None,
        )
        w.add_history(rid, history)
        w.computed[rid] = 0
        w.policy.enqueue(w.waiting, rid, w.views, front=False)
    except BaseException:
        w.abort()
        raise
    return w.freeze(step=state.step)


def abort_requests(state: SchedulerState, request_ids: Iterable[str], *,
                   kv_connector: KVConnector | None = None) -> SchedulerState:
    """A new state where the given requests are finished as aborted and their blocks freed.

    Unknown or already finished ids are ignored (a client may abort a finished request). A
    request aborted while its KV is loaded asynchronously keeps its blocks until the load is
    reported finished, and `kv_connector` may hold any aborted request's blocks to save them
    (docs/SCHEDULING.md §11).
    """
    if kv_connector is not None:
        kv_transfer.require_one_group(state.config)
    w = Work(state)
    try:
        aborted = {r for r in request_ids if r in w.static}
        for rid in aborted:
            w.finish(rid, kv_connector)
        w.running = [r for r in w.running if r not in aborted]
        w.waiting = [r for r in w.waiting if r not in aborted]
    except BaseException:
        w.abort()
        raise
    return w.freeze(step=state.step)


def reset_prefix_cache(state: SchedulerState) -> SchedulerState:
    """A new state whose KV pool caches nothing (vLLM's `reset_prefix_cache`): every usable
    block free in the initial order, no hash registered. Queues, counters and the finished ids
    still to report are kept. For when the cached KV no longer holds (new model weights).

    Raises:
        ValueError: a request is unfinished or a KV connector holds blocks (their KV is in
            use); the input state is unchanged.
    """
    if state._static or state.held_req_ids:
        raise ValueError(f"cannot reset the prefix cache while {len(state._static)} requests "
                         f"are unfinished and a KV connector holds {len(state.held_req_ids)} "
                         f"finished ones' blocks; finish or abort them first")
    return dataclasses.replace(state, num_free_blocks=state.config.num_blocks - 1,
                               _data=Version.initial(StateData(state.config.num_blocks)))


def grammars_ready(state: SchedulerState, request_ids: Iterable[str]) -> SchedulerState:
    """A new state where the given requests' grammars are compiled (docs/SCHEDULING.md §12):
    each that was WAITING_FOR_FSM becomes WAITING, so the next `schedule()` that reaches it in
    `waiting` admits it in its place. Other ids (unknown, finished, already ready) are ignored:
    a request may be aborted while its grammar compiles."""
    static = state._static
    ready = [r for r in request_ids if r in static and static[r].status == _FSM]
    if not ready:
        return state
    w = Work(state)
    try:
        for rid in ready:
            w.update(rid, status=RequestStatus.WAITING)
    except BaseException:
        w.abort()
        raise
    return w.freeze(step=state.step)


def update_from_output(
    state: SchedulerState, output: SchedulerOutput, sampled_token_ids: Mapping[str, Sequence[int]],
    draft_token_ids: Mapping[str, Sequence[int]] | None = None, *,
    stopped: Mapping[str, str] | None = None, kv_connector: KVConnector | None = None,
    kv_connector_output: KVConnectorOutput | None = None,
) -> tuple[SchedulerState, tuple[RequestDelta, ...]]:
    """Apply the tokens sampled in the step `output` planned (docs/SCHEDULING.md §4).

    Args:
        state: the state `schedule()` returned with `output`.
        output: that step's plan.
        sampled_token_ids: per request of `output.sampling_req_ids`, the tokens it sampled (1,
            or 1 + accepted drafts under speculative decoding); other requests are ignored.
        draft_token_ids: optional new draft tokens per request, verified in the next step.
        stopped: request id -> the stop string (`SamplingParams.stop`) that the engine's
            detokenizer found in the text of the tokens it sampled in this step. Each such
            request that gets tokens here finishes as stopped with that `stop_reason`, even if
            it also met EOS, a stop token or a length limit in this step (the string wins, as
            in vLLM); other ids are ignored.
        kv_connector: asked whether to hold each finishing request's blocks to save them
            (docs/SCHEDULING.md §11).
        kv_connector_output: what the connector's worker side reports with this step: loads
            and saves finished, blocks that failed to load (§11).

    Returns:
        The new state and one delta per request that got tokens (in `sampling_req_ids` order).
    """
    if kv_connector is not None or kv_connector_output is not None:
        kv_transfer.require_one_group(state.config)
    w = Work(state)
    try:
        deltas = _apply_outputs(w, output, sampled_token_ids)
        if stopped:
            deltas = [RequestDelta(d.request_id, d.new_token_ids, _STOP, stopped[d.request_id])
                      if d.request_id in stopped else d for d in deltas]
        done = {d.request_id for d in deltas if d.finish_reason is not None}
        for rid in done:
            w.finish(rid, kv_connector)
        if done:
            w.running = [r for r in w.running if r not in done]
            w.waiting = [r for r in w.waiting if r not in done]
        for rid, drafts in (draft_token_ids or {}).items():
            if rid in w.static and w.static[rid].status == RequestStatus.RUNNING:
                w.update(rid, spec_token_ids=tuple(drafts))
        if kv_connector_output is not None:
            kv_transfer.apply_output(w, kv_connector_output)
    except BaseException:
        w.abort()
        raise
    return w.freeze(step=state.step), tuple(deltas)


_STOP = RequestStatus.FINISHED_STOPPED.finish_reason


def _apply_outputs(w: Work, output: SchedulerOutput,
                   sampled_token_ids: Mapping[str, Sequence[int]]) -> list[RequestDelta]:
    # One iteration per scheduled request per step: columns are bound to locals.
    static, append = w.static, w.append_token
    placeholders = w.placeholders
    max_model_len = w.config.max_model_len
    spec_scheduled = output.scheduled_spec_decode_tokens
    deltas = []
    for rid in output.sampling_req_ids:  # a partial prefill chunk samples nothing
        req = static.get(rid)
        if req is None:
            continue  # aborted while the model ran
        params, num_prompt, eos = req.sampling_params, len(req.prompt_token_ids), req.eos_token_id
        sampled = sampled_token_ids.get(rid) or ()
        if spec_scheduled and rid in spec_scheduled:
            _verify_drafts(w, rid, spec_scheduled[rid], len(sampled))
        elif placeholders and rid in placeholders:  # async: the owed tokens have arrived
            _settle_placeholders(placeholders, rid, len(sampled))
        if len(sampled) == 1:  # the common case: one token, no list, no loop
            token = sampled[0]
            status, stop_reason = check_stop(params, num_prompt, eos, append(rid, token),
                                             token, max_model_len)
            deltas.append(RequestDelta(rid, (token,), status and status.finish_reason,
                                       stop_reason))
            continue
        kept: list[int] = []
        status = stop_reason = None
        for token in sampled:
            kept.append(token)
            status, stop_reason = check_stop(params, num_prompt, eos, append(rid, token),
                                             token, max_model_len)
            if status is not None:
                break  # tokens after a stop are dropped
        if kept:
            deltas.append(RequestDelta(rid, tuple(kept), status and status.finish_reason,
                                       stop_reason))
    return deltas


def _settle_placeholders(placeholders: dict[str, int], rid: str, num_sampled: int) -> None:
    left = placeholders[rid] - num_sampled
    if left > 0:
        placeholders[rid] = left
    else:
        del placeholders[rid]


def _verify_drafts(w: Work, rid: str, drafts: tuple[int, ...], num_sampled: int) -> None:
    """The drafts were verified this step: roll back the KV of rejected ones. Under async
    scheduling the request sat out every step planned since (docs/SCHEDULING.md §4.1), so all
    it was owed arrives now."""
    w.update(rid, spec_token_ids=())
    w.placeholders.pop(rid, None)
    if num_sampled and w.computed[rid] > 0:
        rejected = len(drafts) - (num_sampled - 1)
        w.computed[rid] -= rejected


def check_stop(params: SamplingParams, num_prompt_tokens: int, eos_token_id: int | None,
               num_tokens: int, token: int, max_model_len: int
               ) -> tuple[RequestStatus | None, int | None]:
    """Whether a request finishes with the token it just got: (FINISHED_STOPPED or
    FINISHED_LENGTH_CAPPED, the stop token id when one ended it), or (None, None).

    Args:
      params: the request's sampling parameters.
      num_prompt_tokens: its prompt's length.
      eos_token_id: its EOS id (None: none).
      num_tokens: its tokens, prompt and outputs, with `token` counted.
      token: the token it just got.
      max_model_len: the engine's longest sequence.
    """
    num_output = num_tokens - num_prompt_tokens
    if num_output >= params.min_tokens:
        if token == eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED, None
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH_CAPPED, None
    if num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED, None
    return None, None
