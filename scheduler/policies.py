"""Scheduling policies as plug-ins (docs/SCHEDULING.md §8).

A policy decides two things and nothing else: (a) where a request goes in `waiting`, (b) which
running request to preempt when the KV pool is short. Everything else (budgets, blocks, caching)
is the shared mechanism in `scheduler.schedule`, which never looks at the policy's name. To add a
research policy, subclass `Policy` (or `SortedPolicy`) and `register` it:

    @register
    class ShortestPromptFirst(SortedPolicy):
        name = "sjf"
        def sort_key(self, r): return (len(r.prompt_token_ids), r.arrival_time, r.request_id)

then `SchedulerConfig(policy="sjf", ...)`.
"""

import bisect
from collections.abc import Mapping, Sequence
from typing import ClassVar

from scheduler.request import Request

POLICIES: dict[str, "Policy"] = {}


def register[P: type["Policy"]](cls: P) -> P:
    """Class decorator: make `cls.name` usable as `SchedulerConfig.policy`."""
    POLICIES[cls.name] = cls()
    return cls


def get_policy(name: str) -> "Policy":
    return POLICIES[name]


class Policy:
    """First come, first served order for `waiting`; preempted requests go to its front."""

    name: ClassVar[str]

    def enqueue(self, waiting: list[str], rid: str, requests: Mapping[str, Request], *,
                front: bool) -> None:
        """Put `rid` into `waiting` (in place). `front` is set for preempted and skipped
        requests, which keep their place ahead of newer arrivals."""
        if front:
            waiting.insert(0, rid)
        else:
            waiting.append(rid)

    def victim(self, running: Sequence[str], requests: Mapping[str, Request]) -> str:
        """The running request to preempt when the pool is short."""
        return running[-1]


@register
class FCFS(Policy):
    """vLLM's default: admission in arrival order, preempt the most recently admitted."""

    name = "fcfs"


class SortedPolicy(Policy):
    """`waiting` kept sorted by `sort_key` (lowest first); the victim is the highest key."""

    def sort_key(self, request: Request) -> tuple:
        raise NotImplementedError

    def enqueue(self, waiting: list[str], rid: str, requests: Mapping[str, Request], *,
                front: bool) -> None:
        key = self.sort_key
        bisect.insort(waiting, rid, key=lambda r: key(requests[r]))

    def victim(self, running: Sequence[str], requests: Mapping[str, Request]) -> str:
        key = self.sort_key
        return max(running, key=lambda r: key(requests[r]))


@register
class Priority(SortedPolicy):
    """Lower `priority` first; ties by arrival time, then request id."""

    name = "priority"

    def sort_key(self, request: Request) -> tuple:
        return (request.priority, request.arrival_time, request.request_id)


@register
class ShortestRemainingPromptFirst(SortedPolicy):
    """Research policy: admit the request with the least prompt left to compute first.

    Short prompts stop queueing behind long ones (lower mean TTFT, at the risk of starving
    long prompts). Preemption still takes the most recently admitted request, as FCFS does.
    """

    name = "srpf"

    def sort_key(self, request: Request) -> tuple:
        return (len(request.prompt_token_ids), request.arrival_time, request.request_id)

    def victim(self, running: Sequence[str], requests: Mapping[str, Request]) -> str:
        return running[-1]
