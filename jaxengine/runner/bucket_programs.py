"""The runner's executables by bucket: the step of each token bucket and the sampler of each
request bucket, each made (`make_program`: loaded whole, else compiled and saved) either before
the runner is ready or afterwards, on a background thread (`Runner.precompile`).

A step that needs a program still being made there waits for it: a program is made once,
never a second time on the request path. One not started yet is made at once on a thread of
its own, beside the one in progress (a first request's prefill needs one bucket, not every
smaller one first, nor the end of the load under way: on an idle machine the step's own core
sits free while it waits). `stop` ends the background making (a runner's `shutdown`): the
programs in progress are finished, the others are never made.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxengine.runner import executables
from jaxengine.runner.compilation_cache import active_dir
from jaxengine.runner.compiles import cache_hit_count, record_load

logger = logging.getLogger("jaxengine.runner")

Bucket = tuple[str, int]  # ("step", tokens) or ("sample", requests)
THREAD_NAME = "jaxengine-programs"  # the background threads' name
ALL_READY = "background programs done"  # how the log line that says so begins


class BucketPrograms:
    """Compiled programs by bucket, some of them still being made in the background."""

    def __init__(self) -> None:
        self._programs: dict[Bucket, Future[jax.stages.Compiled]] = {}
        self._pending: list[Bucket] = []  # left to the background thread, not started yet
        self._lock = threading.Lock()  # guards `_pending`, `_threads` and `_stopped`
        self._threads: list[threading.Thread] = []  # one per `make_later`, one per `get` ahead
        self._stopped = False  # `stop` was called: nothing more is made
        self._make: Callable[[Bucket], jax.stages.Compiled] | None = None  # `make_later`'s
        self._left = 0  # `make_later`'s programs not done yet (guarded by `_left_lock`)
        self._left_lock = threading.Lock()  # not `_lock`: `stop` cancels (runs `_done`) under it
        self._since = 0.0  # when the first `make_later` began

    def put(self, bucket: Bucket, compiled: jax.stages.Compiled) -> None:
        """`bucket`'s program, ready now."""
        done: Future[jax.stages.Compiled] = Future()
        done.set_result(compiled)
        self._programs[bucket] = done

    def make_later(self, buckets: Sequence[Bucket],
                   make: Callable[[Bucket], jax.stages.Compiled]) -> None:
        """Make `buckets`' programs with `make`, one after another in this order (but for one
        a step waits for: `get`), on a background thread; `get` waits for one not made yet."""
        with self._left_lock:
            self._since = self._since or time.perf_counter()
            self._left += len(buckets)
        with self._lock:
            self._make = make
            for bucket in buckets:
                self._programs[bucket] = program = Future()
                program.add_done_callback(functools.partial(self._done, bucket))
                self._pending.append(bucket)
            self._start_thread(self._make_pending)

    def _start_thread(self, target: Callable[..., None], *args: Any) -> None:
        """(Under `_lock`.) Run `target(*args)` on a new background thread. Not a daemon: a
        process that exits first waits for it, so what it makes is saved for the next start."""
        thread = threading.Thread(target=target, args=args, name=THREAD_NAME)
        self._threads.append(thread)
        thread.start()

    def stop(self) -> None:
        """Make nothing more in the background: the programs not started are cancelled (a
        `get` of one raises), the one in progress is finished (XLA cannot be interrupted);
        returns once the background threads have ended. A failure after this is only logged
        at debug level (its runner is gone, and maybe the cache directory it wrote to)."""
        with self._lock:
            self._stopped = True
            for bucket in self._pending:
                self._programs[bucket].cancel()
            self._pending.clear()
            threads = list(self._threads)
        for thread in threads:
            thread.join()

    def _make_pending(self) -> None:
        """The background thread: make the pending programs, front first, until none is left."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                bucket = self._pending.pop(0)
            self._make_one(bucket)

    def _make_one(self, bucket: Bucket) -> None:
        """Make `bucket`'s program (taken off `_pending`) into its future, with `make_later`'s
        `make`."""
        program = self._programs[bucket]
        program.set_running_or_notify_cancel()
        try:
            program.set_result(self._make(bucket))
        except BaseException as error:  # the step that needs it raises it
            program.set_exception(error)

    def get(self, bucket: Bucket) -> jax.stages.Compiled | None:
        """`bucket`'s program, once made (waiting for it if it is being made, and making it
        at once on a thread of its own if it is not started); None when it was never asked
        for (the caller compiles through jit).

        Raises:
          whatever making it raised.
        """
        program = self._programs.get(bucket)
        if program is None:
            return None
        if program.cancelled():
            raise RuntimeError(f"the {bucket[0]} program of {bucket[1]} was never made: its "
                               f"runner was shut down")
        if not program.done():
            with self._lock:
                if bucket in self._pending:  # so `make_later` has set `_make`
                    self._pending.remove(bucket)
                    self._start_thread(self._make_one, bucket)
            logger.info("a step waits for its program (%s), still being made in the "
                        "background", describe(bucket))
        return program.result()

    def wait(self) -> None:
        """Wait until every program asked for is made (raising what making one raised)."""
        for program in list(self._programs.values()):
            program.result()

    def _done(self, bucket: Bucket, program: Future[jax.stages.Compiled]) -> None:
        """Say at once when a background program failed (a step needing it raises the
        error), quietly once stopped; and when the last one is made (a server is then warm
        for every request size: `benchmarks/startup.py` waits for this line)."""
        if not program.cancelled() and (error := program.exception()) is not None:
            logger.log(logging.DEBUG if self._stopped else logging.ERROR,
                       "making the program (%s) in the background failed: %s: %s",
                       describe(bucket), type(error).__name__, error)
        with self._left_lock:
            self._left -= 1
            if self._left or self._stopped:
                return
            seconds = time.perf_counter() - self._since
        logger.info("%s: every program is ready, %.1f s after the background began", ALL_READY,
                    seconds)


def describe(bucket: Bucket) -> str:
    """`bucket`'s program in words, for the log: "step for 8 tokens", "sample for 16 requests"."""
    kind, size = bucket
    return f"{kind} for {size} {'tokens' if kind == 'step' else 'requests'}"


def make_program(what: str, name: str, jitted: Any, args: tuple[Any, ...],
                 statics: dict[str, Any], *, signature: str | None,
                 devices: Sequence[jax.Device]) -> jax.stages.Compiled:
    """A program of the runner: loaded whole when it was saved before, else lowered, compiled
    and saved (jaxengine/runner/executables.py); logged with its time and where it came from.
    Without a compilation cache directory or a model `signature` nothing is saved or loaded.

    Args:
      what: the program in words, for the log (`describe`).
      name: the jitted function's name; `jitted` the function.
      args: its abstract arguments; `statics` its static ones, by name.
      signature: the model's (`jaxengine.model.fns.signature`).
      devices: where it runs, in its device assignment's order.
    """
    t0 = time.perf_counter()
    where = active_dir()
    key = None if where is None or signature is None else executables.program_key(
        name, args, statics, signature=signature, devices=devices)
    compiled = None if key is None else executables.load(where, name, key, devices)
    if compiled is not None:
        record_load(name)
        how = " (loaded whole from the compilation cache)"
    else:
        compiled, how = _compile(jitted.lower(*args, **statics), name,
                                 None if key is None else (where, key))
    logger.info("compiled %s in %.2f s%s", what, time.perf_counter() - t0, how)
    return compiled


def _compile(lowered: jax.stages.Lowered, name: str, saved_as: tuple[str, str] | None
             ) -> tuple[jax.stages.Compiled, str]:
    """`lowered` compiled, and the log's note on where it came from; saved whole (into
    directory `saved_as[0]` under key `saved_as[1]`) when XLA really compiled it. One that JAX
    read from its persistent cache would not run once saved (jaxengine/runner/executables.py),
    so it is compiled once more under the key's second options, which JAX's cache has not
    seen."""
    hits = cache_hit_count(name, this_thread=True)
    if saved_as is None:
        compiled = lowered.compile()
        return compiled, (" (loaded from the compilation cache)"
                          if cache_hit_count(name, this_thread=True) > hits else "")
    where, key = saved_as
    for attempt in (0, 1):
        compiled = lowered.compile(executables.compiler_options(key, attempt=attempt))
        if cache_hit_count(name, this_thread=True) == hits:
            executables.save(where, name, key, compiled)
            return compiled, ""
        hits = cache_hit_count(name, this_thread=True)
    logger.info("%s came from the compilation cache under both of its key's options: not "
                "saved whole", name)
    return compiled, " (loaded from the compilation cache)"


def abstract(tree: Any) -> Any:
    """`tree`'s arrays as `ShapeDtypeStruct`s: with their sharding where committed to one,
    without where not (jit places those on the default device), as jit lowers for them."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, weak_type=x.weak_type,
        sharding=x.sharding if getattr(x, "committed", True) else None), tree)


def spec(x: Any) -> jax.ShapeDtypeStruct:
    """Host value `x`'s (numpy's) shape and dtype, without a sharding: jit places such an
    argument on the default device."""
    x = np.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def devices_of(kv: jax.Array) -> list[jax.Device]:
    """The devices the programs over pool `kv` run on, in their device assignment's order."""
    sharding = kv.sharding
    if isinstance(sharding, NamedSharding):
        return list(sharding.mesh.devices.flat)
    return sorted(sharding.device_set, key=lambda d: d.id)
