"""The real replay of a workload: an `LLMEngine` run online, honouring arrival times.

The engine is built and warmed up (every bucket compiled, so no step compiles), and the
garbage collected, before the clock starts at t=0. Then, as an online server would: each
request is added once its `arrival_time` has passed (with that arrival time, so its
latencies count from when it arrived), the engine steps while any request is unfinished,
and it sleeps until the next arrival when none is. Every request generates exactly
`max_tokens` tokens (greedy, EOS ignored). The result has the simulator's format
(`jaxengine.lab.results`), with a `StepRecord` per call (`jaxengine.lab.timeline.EngineTimeline`).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import build_engine
from jaxengine.lab import trust
from jaxengine.lab.results import RunResult, request_result
from jaxengine.lab.timeline import EngineTimeline
from jaxengine.lab.workloads import Workload
from jaxengine_kernels import default_impl
from scheduler import SamplingParams


def recorded_args(args: EngineArgs) -> dict[str, Any]:
    """`args` as a calibration or a real run records them: the attention backend as resolved,
    not None (what None picks depends on the platform and on whether the native CPU kernel
    builds, `jaxengine_kernels.default_impl`)."""
    return dataclasses.asdict(args) | {"attention_backend": args.attention_backend
                                       or default_impl()}


def build_warm_engine(args: EngineArgs) -> Any:
    """`build_engine(args)`, warmed up (`warm_up`) unless `args.precompile` is False."""
    engine = build_engine(dataclasses.replace(args, precompile=None))  # warm_up compiles
    if args.precompile is not False:
        warm_up(engine)
    return engine


def warm_up(engine: Any) -> None:
    """Compile every bucket, then run each token bucket and each request bucket once.

    Compiling is not enough: the first run of each bucket is several times slower than later
    ones (the host side of a new shape is slow once), which would be charged to the first
    requests.
    """
    engine.runner.precompile(progress=False)
    engine.runner.mark_warm()
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    longest = engine.max_model_len - params.max_tokens
    batches = [[1] * r for r in engine.runner.request_buckets]
    batches += [[min(b, longest)] for b in engine.runner.token_buckets]
    for n, lengths in enumerate(batches):
        for k, length in enumerate(lengths):
            engine.add_request(f"warm-up-{n}-{k}", [1] * length, params)
        while engine.has_unfinished_requests():
            engine.step()


def replay(workload: Workload, engine: Any) -> RunResult:
    """Run `workload` online on `engine` (idle, warm); the run's result.

    Raises:
      ValueError: a request the engine refuses (too long, a token id beyond the vocabulary);
        the message names it.
    """
    pending = workload.by_arrival
    # Keep a collection made due by the warm-up's garbage out of the timed steps: in a process
    # holding many objects (the test suite's) it can pause one step longer than a short run.
    gc.collect()
    load_start = trust.load_average()
    t0 = time.time()
    timeline = EngineTimeline(engine, clock=time.time)  # its records count from ~t0
    outputs: dict[str, Any] = {}
    i = 0
    while i < len(pending) or engine.has_unfinished_requests():
        now = time.time() - t0
        while i < len(pending) and pending[i].arrival_time <= now:
            _add(engine, pending[i], t0)
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[i].arrival_time - (time.time() - t0)))
            continue
        for out in timeline.step():
            if out.finished:
                outputs[out.request_id] = out
    requests = tuple(request_result(r, outputs[r.request_id].metrics,
                                    num_cached_tokens=outputs[r.request_id].num_cached_tokens)
                     for r in workload.requests)
    duration = max(o.metrics.finished_time for o in outputs.values()) - t0
    steps = tuple(dataclasses.asdict(s) for s in timeline.records)
    info = {"kind": "real", "engine_args": recorded_args(engine.args),
            # 1-minute load averages at the start and the end, and the machine (see
            # calibrate's: `trust.run_differences` compares them)
            "load_average": [load_start, trust.load_average()], **trust.machine(),
            "num_blocks": engine.scheduler_config.num_blocks, "steps": len(steps)}
    return RunResult(duration=duration, requests=requests, steps=steps, info=info)


def _add(engine: Any, r: Any, t0: float) -> None:
    params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
    try:
        engine.add_request(r.request_id, {"prompt_token_ids": list(r.prompt_token_ids)},
                           params, arrival_time=t0 + r.arrival_time, priority=r.priority,
                           metadata={"tenant": r.tenant} if r.tenant is not None else None)
    except ValueError as e:
        raise ValueError(f"workload request {r.request_id!r}: {e}") from None


def bench(workload: Workload, args: EngineArgs) -> RunResult:
    """Build a warm engine from `args` and replay `workload` on it."""
    return replay(workload, build_warm_engine(args))
