"""When not to trust the lab: a calibration whose fit is poor, a real run unlike its calibration.

A simulation is as near as its step prices (docs/LAB.md, Accuracy), and they hold only for what
the calibration measured: a fit whose held-out error is large prices steps badly whatever the
run, and a good fit still prices the steps of its own engine settings, on its own machine,
under the load other processes put on it then. Calibration and real runs record the machine
and its load (`machine`, `load_average`); `fit_warnings` says when a calibration's fit is poor
and what to do, `run_differences` what differs between a simulated run and the real run it is
compared with.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping
from typing import Any

import jax

from jaxengine.lab.cost_model import CostModel
from jaxengine.lab.results import RunResult

# A calibration whose median relative error on its held-out calls is above this is warned of:
# docs/LAB.md's quiet-machine calibrations scored 7-10%, a 6-minute one under other load 48%
# (its simulations then missed TTFT by +220%).
POOR_FIT_MEDIAN_ERROR = 0.20
# Load differences beyond this many busy CPUs are warned of: in docs/LAB.md's loaded rounds the
# replays within half a load unit of their calibration's (2 CPUs) were mostly on target, those
# a whole unit or more away were not.
LOAD_DIFFERENCE_PER_CPU = 0.25
# Engine arguments that change neither the plans nor a step's work: never a difference.
UNPRICED_ARGS = ("seed", "precompile", "compilation_cache_dir", "debug_recompiles",
                 "max_logprobs", "skip_tokenizer_init", "generation_config",
                 "coordinator_address", "num_processes", "process_id")
# What `calibrate` can be told to do about a poor fit (its flags).
_ADVICE = ("calibrate again on a quiet machine (nothing else running), with more passes over "
           "the grid (--repeats 3) or a wider one (--max-scene-tokens 8192; the engine flags "
           "--max-num-seqs, --max-num-batched-tokens and --max-model-len set its batches, "
           "prompt buckets and contexts)")


def machine() -> dict[str, Any]:
    """The machine a run or calibration ran on: JAX backend, device kind, CPU count."""
    device = jax.devices()[0]
    return {"backend": jax.default_backend(),
            "device": getattr(device, "device_kind", str(device)), "cpu_count": os.cpu_count()}


def load_average() -> float:
    """The 1-minute load average now (runnable processes, averaged over a minute)."""
    return os.getloadavg()[0]


def describe_load(info: Mapping[str, Any]) -> str:
    """A run's or calibration's load in words: '2.2 at the start, median 2.3 while timing,
    2.4 at the end, on 2 CPUs'."""
    start, end = info["load_average"]
    during = info.get("load_samples")
    middle = f", median {statistics.median(during):.2f} while timing" if during else ""
    cpus = info.get("cpu_count")
    return (f"{start:.2f} at the start{middle}, {end:.2f} at the end"
            f"{f', on {cpus} CPUs' if cpus else ''}")


def typical_load(info: Mapping[str, Any]) -> float:
    """The load a run saw: the median of the samples taken while it ran where there are some
    (`calibrate` takes one a scene), else the mean of the start and end."""
    return statistics.median(info.get("load_samples") or info["load_average"])


def fit_warnings(model: CostModel) -> list[str]:
    """What makes `model`'s prices doubtful in themselves: a held-out median relative error
    above `POOR_FIT_MEDIAN_ERROR`, with the load it was calibrated under and what to do."""
    fit = model.fit
    if fit is None or fit.median_rel_error <= POOR_FIT_MEDIAN_ERROR:
        return []
    load = f" (machine load {describe_load(model.info)})" if "load_average" in model.info else ""
    return [f"the calibration's fit is poor: median error {fit.median_rel_error:.0%} (p90 "
            f"{fit.p90_rel_error:.0%}) on {fit.held_out_points} held-out calls, above "
            f"{POOR_FIT_MEDIAN_ERROR:.0%}{load}, so simulations priced by it may be far off; "
            f"{_ADVICE}"]


def run_differences(simulated: RunResult, real: RunResult, cost: CostModel) -> list[str]:
    """What differs between a simulated run (priced by `cost`) and the real run it is compared
    with, each in words: an engine argument (of those that change the plans or a step's work),
    the machine, or the load beyond `LOAD_DIFFERENCE_PER_CPU` busy CPUs. Empty when nothing
    does (as far as the results record: a result without a field is not compared on it)."""
    out = []
    ours, theirs = simulated.info.get("engine_args", {}), real.info.get("engine_args", {})
    for key in sorted((ours.keys() & theirs.keys()) - set(UNPRICED_ARGS)):
        if ours[key] != theirs[key]:
            out.append(f"{key}: the real run's {theirs[key]!r}, the simulation's {ours[key]!r} "
                       f"(calibrated with {cost.engine_args.get(key)!r})")
    calibrated = {"backend": cost.backend, "device": cost.device,
                  "cpu_count": cost.info.get("cpu_count")}
    for key, value in calibrated.items():
        if value is not None and real.info.get(key, value) != value:
            out.append(f"{key}: the real run's {real.info[key]!r}, the calibration's {value!r}")
    if "load_average" in real.info and "load_average" in cost.info:
        cpus = cost.info.get("cpu_count") or os.cpu_count() or 1
        ran, priced = typical_load(real.info), typical_load(cost.info)
        if abs(ran - priced) > LOAD_DIFFERENCE_PER_CPU * cpus:
            out.append(f"machine load: the real run's {describe_load(real.info)}; the "
                       f"calibration's {describe_load(cost.info)}: step times follow the load "
                       f"(docs/LAB.md, Accuracy), so calibrate under the load the runs will see")
    return out
