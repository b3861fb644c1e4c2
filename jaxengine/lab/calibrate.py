"""Calibration: time real `LLMEngine.step()` calls over a designed grid, fit a `CostModel`.

The engine is built from the given `EngineArgs` (real weights, the real runner, sampler and
host work) and warmed up first (`Runner.precompile`), so no compilation is timed. The grid is a
list of scenes; a scene starts `decodes` requests with prompts of `context` tokens, lets them
prefill (chunked at the engine's budget) and decode for a few steps, then adds prompts of each
`inject` length while they keep decoding (a prefill mixed into a decode batch, chunked if
longer than the budget), and ends by aborting everything. Every call is timed end to end and
paired with the plan it completed (`scheduler.schedule` of the engine's snapshot is exactly the
plan its next step computes: the scheduler is pure). Held-out scenes (every `hold_out_every`-th)
measure the fit's error on points it did not see; the saved coefficients are then refitted on
all scenes.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import numpy as np

from jaxengine.engine.args import EngineArgs
from jaxengine.lab import trust
from jaxengine.lab.bench import build_warm_engine, recorded_args
from jaxengine.lab.cost_model import (
    FEATURES,
    CostModel,
    fit_coefficients,
    fit_report,
    plan_features,
)
from scheduler import SamplingParams, SchedulerOutput, schedule

# Reweighting rounds of the fit (`fit_coefficients`): more of docs/LAB.md's held-out replays
# within the targets (duration 20%, p50 TTFT and e2e 30%) than with weights 1/y only (rounds 0).
FIT_ROUNDS = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class Scene:
    """One calibration run: `decodes` requests of `context`-token prompts, then injections."""

    decodes: int
    context: int
    inject: tuple[int, ...] = ()  # prompt lengths added one at a time while the batch decodes
    decode_steps: int = 4  # decode-only calls timed before the injections and after each


def default_grid(*, max_num_seqs: int, budget: int, max_model_len: int,
                 max_prefill_tokens: int = 4096) -> list[Scene]:
    """Scenes over decode batch sizes, contexts and injected prefills that fit the engine.

    A scene's prefill work is kept below `max_prefill_tokens` (it sets the calibration time:
    SmolLM2 f32 on the 2-core CPU prefills about 500 tokens a second). The decode batches are
    every power of two up to `max_num_seqs` (each small token bucket and sampler request
    bucket, so `tokens_upto_*` and `sampler_rows` are seen apart: up to 8 requests share one
    sampler bucket), plus 3 and 48 (more requests in the same buckets: `num_seqs`). The
    injections are a short and a medium prompt and one of 1.5x the budget (a full chunk, then
    one with context). A lone prompt of 3/4 of every power-of-two token bucket from 16 up to
    the budget prefills at an idle engine, as most prompts of a lightly loaded server do (so
    that a replay's lone prefills of a few hundred tokens are checked against calls like them,
    not only against 2048-token chunks, docs/LAB.md); these scenes are spread through the grid,
    so one burst of other load does not fall on all.
    """
    limit = max_model_len // 2
    powers = [1 << k for k in range(max_num_seqs.bit_length())]
    decodes = sorted({d for d in (*powers, 3, 48, max_num_seqs) if d <= max_num_seqs})
    contexts = sorted({c for c in (16, 128, 512, 1536, limit) if 1 <= c <= min(limit, 1536)})
    injects = sorted({p for p in (32, 256, budget + budget // 2) if 2 <= p <= limit})
    scenes = []
    for d in decodes:
        for c in contexts:
            if d * c > max_prefill_tokens:
                continue
            # Injections in every other scene, so half the scenes time pure decode batches.
            inject = tuple(injects) if (len(scenes) % 2 == 0 and d < max_num_seqs) else ()
            scenes.append(Scene(decodes=d, context=c, inject=inject))
    bucket = 16
    lone = []
    while bucket <= budget:
        c = bucket * 3 // 4
        if c <= min(limit, max_prefill_tokens) and c not in contexts:
            lone.append(Scene(decodes=1, context=c))
        bucket *= 2
    gap = len(scenes) // (len(lone) + 1)
    for k, scene in enumerate(lone):  # after every `gap` scenes of the grid
        scenes.insert((k + 1) * gap + k, scene)
    return scenes


@dataclass(frozen=True, slots=True)
class Sample:
    """One timed call: the features of the plan it completed (None: none), its seconds."""

    scene: int
    features: np.ndarray | None  # f64[len(FEATURES)]
    seconds: float


def time_scene(engine, scene: Scene, index: int, *, rng: np.random.Generator,
               buckets: Sequence[int], request_buckets: Sequence[int]) -> list[Sample]:
    """Run one scene on `engine` (idle before and after); every call's `Sample`."""
    samples: list[Sample] = []
    vocab = engine.vocab_size
    max_tokens = engine.max_model_len - max((scene.context, *scene.inject)) - 1
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"c{index}-{k}" for k in range(scene.decodes)]
    for rid in ids:
        engine.add_request(rid, rng.integers(1, vocab, scene.context).tolist(), params)
    state = {"in_flight": None}

    def call() -> None:
        _, plan = schedule(engine.snapshot())
        completed = _completed(engine, plan, state)
        t0 = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - t0
        feats = None if completed is None else plan_features(completed, buckets, request_buckets)
        samples.append(Sample(index, feats, seconds))

    def decoding(rids: Sequence[str]) -> bool:
        s = engine.snapshot()
        return all(s.requests[r].num_computed_tokens >= s.requests[r].num_prompt_tokens
                   for r in rids if r in s.requests)

    while not decoding(ids):
        call()
    for _ in range(scene.decode_steps):
        call()
    for k, length in enumerate(scene.inject):
        rid = f"c{index}-p{k}"
        engine.add_request(rid, rng.integers(1, vocab, length).tolist(),
                           dataclasses.replace(params, max_tokens=2))
        while not decoding([rid]):
            call()
        for _ in range(scene.decode_steps):
            call()
    engine.abort_request(list(engine.snapshot().requests))
    while engine.has_unfinished_requests():  # nothing left; collects a step still in flight
        engine.step()
    # A step dispatched for the aborted requests may still be running on the device; it would
    # be charged to the next scene's first (idle) call, many times an idle call's time.
    jax.block_until_ready(jax.live_arrays())
    return samples


def _completed(engine, plan: SchedulerOutput, state: dict) -> SchedulerOutput | None:
    """The plan the coming `step()` call completes (see `jaxengine.lab.cost_model`)."""
    live = plan if plan.num_scheduled_tokens else None
    if not engine.config.scheduler.async_scheduling:
        return live
    completed, state["in_flight"] = state["in_flight"], live
    return completed


def calibrate(args: EngineArgs, *, scenes: Sequence[Scene] | None = None,
              hold_out_every: int = 4, seed: int = 0, repeats: int = 1,
              max_scene_tokens: int = 4096, log: Callable[[str], None] = print) -> CostModel:
    """Build an engine from `args`, time `scenes` (default: `default_grid`, its scenes' prefill
    capped at `max_scene_tokens`), fit a cost model.

    `repeats` > 1 runs the grid that many times, every other pass in reverse order, so that a
    burst of other load on the machine falls on different scenes each pass (the samples of a
    scene keep its index: held-out scenes stay held out). The machine's load is logged with
    every scene and kept (`info["load_average"]`, `info["load_samples"]`); a poor fit is
    logged and kept as a warning (`info["warnings"]`, `trust.fit_warnings`).

    Raises:
      ValueError: what `build_engine` raises for bad arguments, or too few timed calls.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    t_start, load_start = time.perf_counter(), trust.load_average()
    log(f"calibrate: machine load {load_start:.2f} (1-minute average) on {os.cpu_count()} CPUs")
    engine = build_warm_engine(dataclasses.replace(args, precompile=None))
    cfg = engine.scheduler_config
    log(f"calibrate: engine ready in {time.perf_counter() - t_start:.1f} s "
        f"(budget {cfg.max_num_batched_tokens} tokens, {cfg.max_num_seqs} seqs, "
        f"{cfg.num_blocks} blocks)")
    grid = list(scenes) if scenes is not None else default_grid(
        max_num_seqs=cfg.max_num_seqs, budget=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len, max_prefill_tokens=max_scene_tokens)
    rng = np.random.default_rng(seed)
    samples: list[Sample] = []
    loads: list[float] = []  # after each scene: other load shows while the engine runs
    for rep in range(repeats):
        order = list(enumerate(grid))
        for i, scene in order[::-1] if rep % 2 else order:
            t0 = time.perf_counter()
            samples += time_scene(engine, scene, i, rng=rng,
                                  buckets=engine.runner.token_buckets,
                                  request_buckets=engine.runner.request_buckets)
            loads.append(trust.load_average())
            log(f"calibrate: pass {rep + 1}/{repeats}, scene {i + 1}/{len(grid)} "
                f"{scene.decodes} x {scene.context} tokens"
                f"{' + ' + str(list(scene.inject)) if scene.inject else ''}: "
                f"{time.perf_counter() - t0:.1f} s, load {loads[-1]:.2f}")
    model = fit_samples(samples, hold_out_every=hold_out_every)
    config, where = engine.config, trust.machine()
    model = dataclasses.replace(
        model, engine_args=recorded_args(args), backend=where["backend"],
        device=where["device"], num_blocks=cfg.num_blocks,
        kv_bytes_per_token=config.cache.kv_bytes_per_block // cfg.block_size,
        kv_budget_bytes=config.cache.kv_budget_bytes,
        max_model_len=cfg.max_model_len,
        model_max_model_len=config.model_max_model_len, vocab_size=engine.vocab_size,
        info={**model.info, "scenes": [dataclasses.asdict(s) for s in grid],
              "repeats": repeats,
              # 1-minute load averages at the start and the end, and after each scene: other
              # processes' load sets the step times (docs/LAB.md, Accuracy), so a replay
              # should run under the same (`trust.run_differences` compares them)
              "load_average": [load_start, trust.load_average()], "load_samples": loads,
              "cpu_count": where["cpu_count"],
              "seconds": round(time.perf_counter() - t_start, 1),
              "date": time.strftime("%Y-%m-%d %H:%M:%S")})
    return _with_warnings(model, log)


def _with_warnings(model: CostModel, log: Callable[[str], None]) -> CostModel:
    """`model` keeping `trust.fit_warnings` of its fit (`info["warnings"]`), each logged."""
    found = trust.fit_warnings(model)
    for message in found:
        log(f"calibrate: warning: {message}")
    return dataclasses.replace(model, info={**model.info, "warnings": found})


def fit_samples(samples: Sequence[Sample], *, hold_out_every: int = 4,
                rounds: int = FIT_ROUNDS) -> CostModel:
    """Fit on the scenes not held out, report on the held-out ones, refit on all.

    Returns:
      A `CostModel` with coefficients, `idle_call_seconds` and `fit`; the fields about the
      engine are placeholders for `calibrate` to fill.
    """
    timed = [s for s in samples if s.features is not None]
    idle = [s.seconds for s in samples if s.features is None]
    x = np.stack([s.features for s in timed])
    y = np.array([s.seconds for s in timed])
    test = np.array([hold_out_every > 0 and s.scene % hold_out_every == hold_out_every - 1
                     for s in timed])
    if test.any() and (~test).sum() >= x.shape[1]:
        report = fit_report(fit_coefficients(x[~test], y[~test], rounds=rounds), x[~test],
                            x[test], y[test])
    else:
        report = None
    coef = fit_coefficients(x, y, rounds=rounds)
    return CostModel(
        coefficients=dict(zip(FEATURES, map(float, coef), strict=True)),
        idle_call_seconds=statistics.median(idle) if idle else float(coef[0]),
        engine_args={}, backend="", device="", num_blocks=0, kv_bytes_per_token=0,
        kv_budget_bytes=0, max_model_len=0, model_max_model_len=0, vocab_size=0, fit=report,
        info={"timed_calls": len(timed), "idle_calls": len(idle),
              # every timed call: scene, the FEATURES of its plan, seconds (for plots, refits)
              "samples": [[s.scene, *map(float, s.features), s.seconds] for s in timed]})


def refit(model: CostModel, *, hold_out_every: int = 4, rounds: int = FIT_ROUNDS,
          log: Callable[[str], None] = print) -> CostModel:
    """`model` fitted again from the timed samples it keeps (`info["samples"]`), without
    timing anything: to try another fit (`rounds`: see `fit_coefficients`). Its warnings are
    those of the new fit.

    Raises:
      ValueError: the model keeps no samples (calibrated before they were kept).
    """
    rows = model.info.get("samples")
    if not rows:
        raise ValueError("this cost model keeps no timed samples; run `jaxengine calibrate`")
    n = len(FEATURES)
    samples = [Sample(int(r[0]), np.array(r[1:1 + n]), float(r[1 + n])) for r in rows]
    fitted = fit_samples(samples, hold_out_every=hold_out_every, rounds=rounds)
    return _with_warnings(dataclasses.replace(
        model, coefficients=fitted.coefficients, fit=fitted.fit,
        info={**model.info, **{k: v for k, v in fitted.info.items() if k != "samples"}}), log)
