"""Data-parallel routing: which replica gets a new request, from the replicas' scheduler states.

A prefix cached on one replica cannot help a request sent to another, so a request goes where
its prompt has the longest prefix-cache hit (`scheduler.prefix_cache_hit`, the hit admission
would give, computed without changing anything); with no hit anywhere it goes to the least
loaded replica (fewest running + waiting requests). Ties go to the less loaded replica, then to
the lowest index. A pure function of immutable states: the same states and request give the
same replica on every process, and a test can call it with states it built by hand.

Only blocks a replica has already scheduled are in its cache: requests added before the same
step (e.g. one `LLM.generate` batch) do not see each other's prefixes and spread by load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler import Request, SchedulerState, prefix_cache_hit


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """Where a request goes, and why."""

    replica: int  # index into the replicas
    hit_tokens: int  # its prefix-cache hit there (0: chosen by load)
    load: int  # that replica's running + waiting requests before this one


def load(state: SchedulerState) -> int:
    """A replica's load: its running plus waiting requests."""
    return len(state.running) + len(state.waiting)


def route(states: Sequence[SchedulerState], request: Request) -> Route:
    """The replica for `request`: the longest prefix-cache hit, else the least loaded.

    Args:
        states: each replica's current scheduler state, in replica order (at least one).
        request: the new request (its prompt, outputs and `cache_salt` decide the hit).
    Returns:
        The chosen replica, its hit in tokens and its load.
    """
    if not states:
        raise ValueError("route needs at least one replica state")
    hits = [prefix_cache_hit(s, request) for s in states]
    loads = [load(s) for s in states]
    best = choose(hits, loads)
    return Route(replica=best, hit_tokens=hits[best], load=loads[best])


def choose(hits: Sequence[int], loads: Sequence[int]) -> int:
    """The rule itself, for any measure of hit and load (the P/D proxy's too,
    `jaxengine/proxy/`): the longest hit, then the least load, then the lowest index.

    Args:
        hits: each candidate's prefix hit (any unit; 0: none).
        loads: each candidate's load, in the same order.
    Returns:
        The chosen candidate's index.
    """
    return min(range(len(hits)), key=lambda i: (-hits[i], loads[i], i))
