"""The simulator's speed: simulated engine steps per second (docs/LAB.md, "The simulator").

Simulates the five held-out workloads of docs/LAB.md's Accuracy (the same seeds and scales as
its `jaxengine workload` commands) and `benchmarks/workloads/mix64.json` with a SmolLM2-sized
cost model (vocabulary 49152, 8192 positions; the coefficients of that section's quiet
calibrations, a 5 ms `const` and 10 ms idle calls), each once to warm up, then `--repeats`
times, and prints the best run's steps per second of each and of all together:

    python benchmarks/simulator_speed.py [--repeats 5]
"""

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxengine.engine.args import EngineArgs  # noqa: E402
from jaxengine.lab.cost_model import FEATURES, CostModel  # noqa: E402
from jaxengine.lab.generators import scenario  # noqa: E402
from jaxengine.lab.simulate import simulate, simulation_args  # noqa: E402
from jaxengine.lab.workloads import load_workload  # noqa: E402

# Seconds per unit of each feature (docs/LAB.md, Accuracy: the quiet calibrations).
COEFFICIENTS = {"const": 5e-3, "padded_tokens": 1.22e-3, "num_seqs": 1e-5,
                "decode_kilotokens": 14.3e-3, "prefill_attention": 0.60}
# (scenario, requests, rate, scale, seed, burst size): docs/LAB.md's Accuracy commands.
WORKLOADS = {"many_short": ("many_short", 32, 2.0, 1.0, 1, 1),
             "srb_mix": ("srb_mix", 24, 1.0, 0.5, 2, 1),
             "short_prompt_long_output": ("short_prompt_long_output", 12, 0.5, 0.25, 3, 1),
             "long_prompt_short_output": ("long_prompt_short_output", 12, 0.5, 0.5, 4, 1),
             "tenants": ("tenants", 24, 2.0, 0.5, 5, 4)}


def smollm2_sized_cost() -> CostModel:
    """A cost model of SmolLM2-135M's sizes with the default engine arguments (async)."""
    return CostModel(coefficients={f: COEFFICIENTS.get(f, 0.0) for f in FEATURES},
                     idle_call_seconds=10e-3, engine_args=dataclasses.asdict(EngineArgs()),
                     backend="cpu", device="cpu", num_blocks=0, kv_bytes_per_token=46080,
                     kv_budget_bytes=1 << 30, max_model_len=8192, model_max_model_len=8192,
                     vocab_size=49152)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per workload")
    ns = parser.parse_args()
    cost = smollm2_sized_cost()
    args = simulation_args(cost)
    workloads = {name: scenario(s, num_requests=n, rate=rate, scale=scale, seed=seed,
                                burst_size=burst)
                 for name, (s, n, rate, scale, seed, burst) in WORKLOADS.items()}
    workloads["mix64"] = load_workload(ROOT / "benchmarks" / "workloads" / "mix64.json")
    total_steps, total_seconds = 0, 0.0
    for name, w in workloads.items():
        simulate(w, cost, args)
        best = float("inf")
        for _ in range(ns.repeats):
            t0 = time.perf_counter()
            result = simulate(w, cost, args)
            best = min(best, time.perf_counter() - t0)
        steps = len(result.steps)
        total_steps, total_seconds = total_steps + steps, total_seconds + best
        print(f"{name:26s} {steps:5d} steps  {best * 1e3:7.1f} ms  {steps / best:7.0f} steps/s")
    print(f"{'all':26s} {total_steps:5d} steps  {total_seconds * 1e3:7.1f} ms  "
          f"{total_steps / total_seconds:7.0f} steps/s")


if __name__ == "__main__":
    main()
