"""Counting XLA compilations per jitted function (docs/JAX_NOTES.md, "Counting compilations").

One process-wide listener on `/jax/core/compile/backend_compile_duration` counts compilations
by `fun_name` (e.g. `'jit(jaxengine_model_step)'`). JAX has no public way to remove a listener,
so it is registered once, lazily, and every runner reads the same counter.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
DEBUG_ENV = "JAXENGINE_DEBUG_RECOMPILES"

_lock = threading.Lock()
_counts: collections.Counter[str] = collections.Counter()
_registered = False


def _listener(event: str, duration_secs: float, **kwargs: Any) -> None:
    del duration_secs
    if event == COMPILE_EVENT:
        with _lock:
            _counts[str(kwargs.get("fun_name", "?"))] += 1


def ensure_listener() -> None:
    """Register the counting listener (idempotent)."""
    global _registered
    with _lock:
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _registered = True


def compile_count(*fun_names: str) -> int:
    """Compilations so far of the jitted functions named `fun_names` (`jit(<name>)` or `<name>`)."""
    wanted = set(fun_names) | {f"jit({n})" for n in fun_names}
    with _lock:
        return sum(c for name, c in _counts.items() if name in wanted)


def debug_recompiles_from_env() -> bool:
    """True when `JAXENGINE_DEBUG_RECOMPILES` is set to a true value (1, true, yes)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in {"1", "true", "yes"}


class RecompileError(RuntimeError):
    """A jitted function compiled again after warm-up (raised only in debug mode)."""
