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

A name is registered once: registering another class under a taken name is an error, so a
research policy never silently replaces a built-in (those defined here can never be replaced)
and re-running a notebook cell never silently swaps a policy's logic. Replacing one's own
policy on purpose is `@register(replace=True)` or `unregister(name)` first. `resolve_policy`
turns the command line's `MODULE:CLASS` into a registered name.
"""

import bisect
import importlib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, overload

from scheduler.policies.request_view import RequestView, RequestViews

POLICIES: dict[str, "Policy"] = {}

Views = RequestViews  # a read-only Mapping: request id -> view, every unfinished request


@overload
def register[P: type["Policy"]](cls: P, /, *, replace: bool = False) -> P: ...
@overload
def register[P: type["Policy"]](*, replace: bool = False) -> Callable[[P], P]: ...
def register(cls: type["Policy"] | None = None, /, *, replace: bool = False) -> Any:
    """Class decorator: make `cls.name` usable as `SchedulerConfig.policy`.

    `@register` or `register(cls)`; `@register(replace=True)` replaces a policy registered
    earlier under the same name (a notebook cell run again), never a built-in one. Registering
    the same class again does nothing.

    Raises:
      ValueError: `cls` is not a `Policy` subclass with a `name`, or the name is taken by
        another class (without `replace`, or by a built-in policy).
    """
    if cls is None:
        return lambda c: register(c, replace=replace)
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise ValueError(f"register takes a subclass of scheduler.Policy; got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy class {cls.__name__} needs a `name`: a non-empty str class "
                         "attribute, the SchedulerConfig.policy it answers to")
    existing = POLICIES.get(name)
    if type(existing) is cls:
        return cls
    if existing is not None and _is_builtin(name):
        raise ValueError(f"policy name {name!r} is a built-in policy's "
                         f"({type(existing).__name__}), which cannot be replaced; "
                         f"give {cls.__name__} another name")
    if existing is not None and not replace:
        raise ValueError(
            f"a policy named {name!r} is already registered ({_origin(type(existing))}); "
            f"give {cls.__name__} another name, or replace it on purpose (say, a notebook cell "
            f"run again) with @register(replace=True) or unregister({name!r}) first")
    POLICIES[name] = cls()
    return cls


def unregister(name: str) -> None:
    """Remove the policy registered as `name` (one's own: built-in policies stay).

    Raises:
      ValueError: no policy has that name, or it is a built-in one.
    """
    if name not in POLICIES:
        raise ValueError(f"no policy named {name!r} is registered; known: {sorted(POLICIES)}")
    if _is_builtin(name):
        raise ValueError(f"policy {name!r} is built in and cannot be unregistered")
    del POLICIES[name]


def _is_builtin(name: str) -> bool:
    """Whether `name` is registered to a policy defined in this module."""
    return type(POLICIES[name]).__module__ == __name__


def _origin(cls: type) -> str:
    return f"{cls.__name__} from {cls.__module__}"


def resolve_policy(spec: str) -> str:
    """The registered policy name that `spec` stands for.

    `spec` is a registered name ("fcfs"), or `MODULE:ATTR` (the command line's
    `--scheduling-policy my_mod:MyPolicy`): MODULE is imported (which registers the policies it
    decorates with `@register`), and ATTR is a `Policy` subclass there (registered now if its
    module did not) or the name of a policy that importing MODULE registered.

    Raises:
      ValueError: an unknown name, a module that does not import, or an ATTR that is neither;
        the message names `spec`.
    """
    module_name, colon, attr = spec.partition(":")
    if not colon:
        if spec not in POLICIES:
            raise ValueError(f"unknown scheduling policy {spec!r}; known: {sorted(POLICIES)}, "
                             "or MODULE:CLASS to import one")
        return spec
    if not module_name or not attr:
        raise ValueError(f"scheduling policy {spec!r}: expected MODULE:CLASS, e.g. "
                         "my_policies:ShortestPromptFirst")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module may fail in any way: say how, and where
        raise ValueError(f"scheduling policy {spec!r}: module {module_name!r} does not import "
                         f"({type(e).__name__}: {e})") from e
    obj = getattr(module, attr, None)
    if obj is None and attr in POLICIES:
        return attr
    if not (isinstance(obj, type) and issubclass(obj, Policy)):
        what = "missing" if obj is None else f"a {type(obj).__name__}"
        raise ValueError(f"scheduling policy {spec!r}: {module_name}.{attr} is {what}, not a "
                         "subclass of scheduler.Policy nor the name of a policy it registers")
    register(obj)
    return obj.name


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
