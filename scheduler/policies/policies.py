"""Scheduling policies as plug-ins (docs/SCHEDULING.md §8).

A policy decides two things and nothing else: (a) where a request goes in `waiting`, (b) which
running request to preempt when the KV pool is short. Everything else (budgets, blocks, caching)
is the shared mechanism in `scheduler.schedule`, which never looks at the policy's name. A policy
sees each request as a `RequestView` (scheduler/policies/request_view.py): what was asked, its
metadata and its progress now. To add a research policy, subclass `Policy` (or `SortedPolicy`) and
`register` it:

    @register
    class ShortestPromptFirst(SortedPolicy):
        name = "sjf"
        def sort_key(self, r): return (r.num_prompt_tokens, r.arrival_time, r.request_id)

then `SchedulerConfig(policy="sjf", ...)`. A policy whose keys can change while requests wait
(progress, the prefix cache, other requests' service) sets `dynamic = True`: `schedule()` then
re-orders `waiting` (`reorder`) before each step; static policies pay nothing for it.
"""

import bisect
from collections.abc import Callable, Sequence
from typing import ClassVar

from scheduler.policies.request_view import RequestView, RequestViews

POLICIES: dict[str, "Policy"] = {}

Views = RequestViews  # a read-only Mapping: request id -> view, every unfinished request


def register[P: type["Policy"]](cls: P) -> P:
    """Class decorator: make `cls.name` usable as `SchedulerConfig.policy`."""
    POLICIES[cls.name] = cls()
    return cls


def get_policy(name: str) -> "Policy":
    return POLICIES[name]


class Policy:
    """First come, first served order for `waiting`; preempted requests go to its front."""

    name: ClassVar[str]
    # True when a waiting request's place can change while it waits: `reorder` runs at the
    # start of every schedule(). False: `waiting` is ordered by `enqueue` alone.
    dynamic: ClassVar[bool] = False

    def enqueue(self, waiting: list[str], rid: str, requests: Views, *, front: bool) -> None:
        """Put `rid` into `waiting` (in place). `front` is set for preempted and skipped
        requests, which keep their place ahead of newer arrivals."""
        if front:
            waiting.insert(0, rid)
        else:
            waiting.append(rid)

    def victim(self, running: Sequence[str], requests: Views) -> str:
        """The running request to preempt when the pool is short."""
        return running[-1]

    def reorder(self, waiting: list[str], requests: Views) -> None:
        """Re-order `waiting` in place before a step; called only when `dynamic` is set."""


@register
class FCFS(Policy):
    """vLLM's default: admission in arrival order, preempt the most recently admitted."""

    name = "fcfs"


class SortedPolicy(Policy):
    """`waiting` kept sorted by `sort_key` (lowest first); the victim is the highest key."""

    def sort_key(self, request: RequestView) -> tuple:
        """The request's place: smaller keys are admitted first."""
        raise NotImplementedError

    def key_function(self, requests: Views) -> Callable[[str], tuple]:
        """Request id -> its key now. Override to compute something over all requests once
        per call (a tenant's total, say) instead of once per key."""
        key = self.sort_key
        return lambda rid: key(requests[rid])

    def enqueue(self, waiting: list[str], rid: str, requests: Views, *, front: bool) -> None:
        bisect.insort(waiting, rid, key=self.key_function(requests))

    def victim(self, running: Sequence[str], requests: Views) -> str:
        return max(running, key=self.key_function(requests))

    def reorder(self, waiting: list[str], requests: Views) -> None:
        waiting.sort(key=self.key_function(requests))


@register
class Priority(SortedPolicy):
    """Lower `priority` first; ties by arrival time, then request id."""

    name = "priority"

    def sort_key(self, request: RequestView) -> tuple:
        return (request.priority, request.arrival_time, request.request_id)


@register
class ShortestRemainingPromptFirst(SortedPolicy):
    """Research policy: admit the request with the least left to compute first.

    What is left is `num_tokens_to_compute`: the prompt minus its prefix-cache hit now, plus,
    for a resumed (preempted) request, the outputs it must recompute. Short work stops queueing
    behind long work (lower mean TTFT, at the risk of starving long prompts). The hit changes
    as the cache fills and empties, so `waiting` is re-sorted every step. Preemption still takes
    the most recently admitted request, as FCFS does.
    """

    name = "srpf"
    dynamic = True

    def sort_key(self, request: RequestView) -> tuple:
        return (request.num_tokens_to_compute, request.arrival_time, request.request_id)

    def victim(self, running: Sequence[str], requests: Views) -> str:
        return running[-1]


@register
class LeastAttainedService(SortedPolicy):
    """Research policy: the request served the fewest tokens so far goes first.

    Attained service is `num_output_tokens` (kept across preemptions), so new requests go
    ahead of resumed ones that already got tokens, and the victim is the running request with
    the most outputs: without knowing output lengths, the one that has run longest is taken to
    be the one with most left to run. Ties by arrival time, then id. Static: a request's outputs
    do not grow while it waits, so its key is the one it was inserted with (one exception, under
    async scheduling: a request preempted while a step samples for it is placed by its count
    before that token arrives).
    """

    name = "las"

    def sort_key(self, request: RequestView) -> tuple:
        return (request.num_output_tokens, request.arrival_time, request.request_id)


@register
class FairShare(Policy):
    """Research policy: per-tenant fair share of served tokens (`metadata["tenant"]`).

    A tenant's service is `num_served_tokens` summed over its finished and unfinished requests.
    Before each step `waiting` is ordered by start-time fair queuing over tokens: a request's
    tag is its tenant's service plus the prompt tokens not yet served of that tenant's requests
    ahead of it in `waiting` (in arrival order), so the tenant with the least service goes
    first and tenants interleave by tokens even within one step. Ties by arrival time, then
    id. The victim is the latest-arrived running request of the tenant with the most service.
    Requests without a tenant share one (None). Between steps, new arrivals wait at the back
    (preempted and set-aside ones at the front) until the next `schedule()` re-orders `waiting`.
    """

    name = "fair"
    dynamic = True

    def victim(self, running: Sequence[str], requests: Views) -> str:
        service = _tenant_service(requests)
        views = [requests[r] for r in running]
        return max(views, key=lambda v: (service[_tenant(v)], v.arrival_time,
                                         v.request_id)).request_id

    def reorder(self, waiting: list[str], requests: Views) -> None:
        service = _tenant_service(requests)
        views = sorted((requests[r] for r in waiting),
                       key=lambda v: (v.arrival_time, v.request_id))
        tags = {}
        for v in views:  # a tenant's earlier waiting requests are served before this one
            tenant = _tenant(v)
            tags[v.request_id] = (service[tenant], v.arrival_time, v.request_id)
            if not v.num_output_tokens:  # in `waiting` no prompt token is served before then
                service[tenant] += v.num_prompt_tokens
        waiting.sort(key=tags.__getitem__)


def _tenant(request: RequestView) -> str | None:
    return request.metadata.get("tenant")


def _tenant_service(requests: Views) -> dict[str | None, int]:
    """Tokens served so far per tenant: its finished requests and every unfinished one."""
    service = dict(requests.finished_served)
    get = service.get
    for rid in requests:
        v = requests[rid]
        tenant = v.metadata.get("tenant")
        service[tenant] = get(tenant, 0) + v.num_served_tokens
    return service
