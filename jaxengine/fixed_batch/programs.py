"""`program_for`: `generate`'s and `score`'s jitted programs, one per model, dropped with it.

JAX's jit caches hold a jitted function's static arguments, and every executable compiled for
them, as long as the jitted function lives. A module-level `jax.jit` taking the model's
functions as static arguments therefore kept every model it was ever given, with its compiled
loops, for the life of the process: a notebook that built `LLM()` after `LLM()` and ran
`generate` and `score` over `model_fns_of(llm)` grew by about 700 MB an engine. So each
program is jitted over one model's functions instead, and reaches them only through weak
references: once one of them is collected (the model is gone) the program, and its
executables, go too. Copies of a `ModelFns` that keep its functions (`dataclasses.replace`
with new params, as new weights make) share the program, so they compile nothing.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxengine.model.fns import ModelFns

_lock = threading.Lock()
# (the program, ids of the model's step, compute_logits and init_kv) -> the jitted program;
# an entry goes when any of the three functions is collected
_programs: dict[tuple[Callable, int, int, int], Callable] = {}


def program_for(program: Callable, model: ModelFns, *, static_argnames: Sequence[str]
                ) -> Callable:
    """`program` jitted with `model`'s functions bound as `step_fn`, `logits_fn` and
    `init_kv_fn` (held weakly), cached for as long as they live.

    Args:
      program: a pure function taking `step_fn`, `logits_fn` and `init_kv_fn` by keyword.
      model: whose functions to bind.
      static_argnames: the program's other static arguments.
    Returns:
      The jitted program; call it without the three functions.
    """
    fns = (model.step, model.compute_logits, model.init_kv)
    key = (program, *map(id, fns))
    with _lock:
        jitted = _programs.get(key)
        if jitted is None:
            step_fn, logits_fn, init_kv_fn = map(_weakly, fns)
            jitted = jax.jit(functools.partial(program, step_fn=step_fn, logits_fn=logits_fn,
                                               init_kv_fn=init_kv_fn),
                             static_argnames=tuple(static_argnames))
            _programs[key] = jitted
            for fn in fns:
                weakref.finalize(fn, _programs.pop, key, None)
        return jitted


def _weakly(fn: Callable) -> Callable:
    """`fn`, called through a weak reference (only while tracing: an executable calls no
    Python)."""
    ref = weakref.ref(fn)

    def call(*args: Any, **kwargs: Any) -> Any:
        return ref()(*args, **kwargs)

    return call
