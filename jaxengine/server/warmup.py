"""Warm-up before serving: the programs a first short request needs are ready before `/health`
is 200, and every other bucket's follow on a background thread (as `LLM()` makes them:
`Runner.precompile(background=True)`); a request that needs one not ready yet waits for it, so
nothing compiles on a request's path. A multi-host run makes every bucket before it serves: its
processes run each step together, and a program one process still makes would hold the others.

`serve` calls `warm_up` before uvicorn listens (on every process of a multi-host run), and
`build_app`'s lifespan calls it before the engine loop starts, so an app built over a cold
engine compiles first as well; a replica that is warm already costs nothing. Progress goes to
the log, not to a bar: `jaxengine.runner` logs one line per bucket with its time and a line per
replica, and `warm_up` a summary with how many programs came from the compilation cache.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import jax

from jaxengine.engine.client import EngineClient
from jaxengine.runner.compilation_cache import active_dir, cache_state, shown
from jaxengine.runner.compiles import cache_hit_count
from jaxengine.runner.programs import SAMPLE_NAME, STEP_NAME

logger = logging.getLogger("jaxengine.server")


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmUp:
    """What one `warm_up` did."""

    replicas: int  # replicas compiled now (those warm before are not counted)
    programs: int  # step and sampler programs compiled or loaded before it returned
    cache_hits: int  # of those, loaded from the persistent compilation cache
    seconds: float  # wall time of the whole warm-up


def warm_up(engine: EngineClient) -> WarmUp:
    """Precompile every replica of `engine` whose runner is not warm yet; log the summary.

    Args:
      engine: an `LLMEngine`, a `DataParallelEngine` or a multi-host `LeaderEngine`; its
        `replicas` are compiled.
    Returns:
      The counts and time of this warm-up (all zero when every replica was warm).
    """
    replicas = engine.replicas
    cold = [i for i, r in enumerate(replicas) if not r.runner.warm]
    if not cold:
        return WarmUp(replicas=0, programs=0, cache_hits=0, seconds=0.0)
    t0, hits0 = time.perf_counter(), cache_hit_count(STEP_NAME, SAMPLE_NAME)
    programs = 0
    for i in cold:
        runner = replicas[i].runner
        before = runner.stats.compilations
        logger.info("warm-up: compiling replica %d of %d (%d token buckets %s, %d request "
                    "buckets %s)", i, len(replicas), len(runner.token_buckets),
                    list(runner.token_buckets), len(runner.request_buckets),
                    list(runner.request_buckets))
        runner.precompile(progress=False, background=jax.process_count() == 1)
        programs += runner.stats.compilations - before
    done = WarmUp(replicas=len(cold), programs=programs,
                  cache_hits=cache_hit_count(STEP_NAME, SAMPLE_NAME) - hits0,
                  seconds=time.perf_counter() - t0)
    logger.info("warm-up done in %.1f s: %d programs over %d replica(s), %s; no request "
                "compiles from now on (a request needing a bucket still being made in the "
                "background waits for it)", done.seconds, done.programs, done.replicas,
                _cache_words(done))
    return done


def _cache_words(done: WarmUp) -> str:
    """How the persistent compilation cache served this warm-up, for the log line."""
    where = active_dir()
    if where is None:
        return "persistent compilation cache disabled"
    state = cache_state(done.cache_hits, done.programs)
    return f"{done.cache_hits} loaded from the compilation cache {shown(where)} ({state})"
