"""Counting XLA compilations per jitted function (docs/JAX_NOTES.md, "Counting compilations").

One process-wide listener on `/jax/core/compile/backend_compile_duration` counts compilations
by `fun_name` (e.g. `'jit(jaxengine_model_step)'`). JAX has no public way to remove a listener,
so it is registered once, lazily, and every runner reads the same counter.

A program loaded from the persistent compilation cache fires that event too (measured, jax
0.12), so it counts as a compilation: it is still a stall, and "nothing compiles after
warm-up" must hold with a warm cache as with a cold one. It is also counted as a cache hit:
JAX records `/jax/compilation_cache/cache_hits` (without the function's name) on the same
thread just before the compile event, so a per-thread flag carries the hit over to the name.
An executable the runner loads whole (jaxengine/runner/executables.py) fires neither: the
runner records it with `record_load`, as a compilation and a hit, for the same reasons.

Each thread also counts its own (`this_thread=True`): a step's stall is what its own thread
compiled, not what a background thread loads meanwhile.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_REQUEST_EVENT = "/jax/compilation_cache/compile_requests_use_cache"  # a lookup starts
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
DEBUG_ENV = "JAXENGINE_DEBUG_RECOMPILES"

_lock = threading.Lock()
_counts: collections.Counter[str] = collections.Counter()  # compile events, hits included
_hits: collections.Counter[str] = collections.Counter()  # of those, loaded from the cache
_pending = threading.local()  # .hit: a cache hit waiting for its compile event
_local = threading.local()  # .counts, .hits: this thread's compile events and cache hits
_registered = False


def _duration_listener(event: str, duration_secs: float, **kwargs: Any) -> None:
    del duration_secs
    if event == COMPILE_EVENT:
        name, hit = str(kwargs.get("fun_name", "?")), getattr(_pending, "hit", False)
        _pending.hit = False
        _count(name, hit=hit)


def _count(name: str, *, hit: bool) -> None:
    with _lock:
        _counts[name] += 1
        _hits[name] += hit
    counts, hits = _thread_counters()
    counts[name] += 1
    hits[name] += hit


def _thread_counters() -> tuple[collections.Counter[str], collections.Counter[str]]:
    if not hasattr(_local, "counts"):
        _local.counts, _local.hits = collections.Counter(), collections.Counter()
    return _local.counts, _local.hits


def _event_listener(event: str, **kwargs: Any) -> None:
    del kwargs
    if event in (CACHE_REQUEST_EVENT, CACHE_HIT_EVENT):
        _pending.hit = event == CACHE_HIT_EVENT


def ensure_listener() -> None:
    """Register the counting listeners (idempotent)."""
    global _registered
    with _lock:
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_duration_listener)
            jax.monitoring.register_event_listener(_event_listener)
            _registered = True


def record_load(fun_name: str) -> None:
    """Count an executable of `fun_name` loaded whole as a compilation and a cache hit, on
    this thread."""
    _count(f"jit({fun_name})", hit=True)


def compile_count(*fun_names: str, this_thread: bool = False) -> int:
    """Compilations so far of the jitted functions named `fun_names` (`jit(<name>)` or `<name>`),
    in the whole process or (`this_thread`) on the calling thread.

    Programs loaded from the persistent cache are included (see `cache_hit_count`).
    """
    return _total(_thread_counters()[0] if this_thread else _counts, fun_names)


def cache_hit_count(*fun_names: str, this_thread: bool = False) -> int:
    """Of `compile_count(*fun_names, this_thread=...)`, the programs loaded from the persistent
    cache (or whole: `record_load`).

    The difference is what XLA really compiled.
    """
    return _total(_thread_counters()[1] if this_thread else _hits, fun_names)


def _total(counter: collections.Counter[str], fun_names: tuple[str, ...]) -> int:
    wanted = _wanted(fun_names)
    with _lock:
        return sum(c for name, c in counter.items() if name in wanted)


def _wanted(fun_names: tuple[str, ...]) -> set[str]:
    return set(fun_names) | {f"jit({n})" for n in fun_names}


@dataclass(frozen=True, slots=True)
class Compiles:
    """Compilations by jitted function name (`jit(<name>)`): what a `RecompileError` names.

    Subtract an earlier snapshot (`compiles_by_name`) to get what compiled in between.
    """

    counts: Mapping[str, int]  # compile events, cache hits and loads included
    hits: Mapping[str, int]  # of those, loaded from the persistent cache or whole

    @property
    def total(self) -> int:
        """All compilations counted (hits included)."""
        return sum(self.counts.values())

    def __sub__(self, before: Compiles) -> Compiles:
        """What was counted since `before` (only names that grew)."""
        grew = {n: c - before.counts.get(n, 0) for n, c in self.counts.items()
                if c > before.counts.get(n, 0)}
        return Compiles(counts=grew, hits={n: self.hits.get(n, 0) - before.hits.get(n, 0)
                                           for n in grew})

    def __str__(self) -> str:
        """E.g. `jit(jaxengine_write_slot) x1 (1 from the cache)`; `nothing` when empty."""
        return ", ".join(f"{n} x{c} ({self.hits.get(n, 0)} from the cache)"
                         for n, c in sorted(self.counts.items())) or "nothing"


def compiles_by_name(*fun_names: str, this_thread: bool = False) -> Compiles:
    """`compile_count` and `cache_hit_count` of each of `fun_names`, by name (a snapshot)."""
    wanted = _wanted(fun_names)
    counts, hits = _thread_counters() if this_thread else (_counts, _hits)
    with _lock:
        return Compiles(counts={n: c for n, c in counts.items() if n in wanted and c},
                        hits={n: c for n, c in hits.items() if n in wanted and c})


def debug_recompiles_from_env() -> bool:
    """True when `JAXENGINE_DEBUG_RECOMPILES` is set to a true value (1, true, yes)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in {"1", "true", "yes"}


class RecompileError(RuntimeError):
    """A jitted function compiled again after warm-up (raised only in debug mode)."""
