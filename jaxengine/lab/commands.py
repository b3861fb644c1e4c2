"""The lab's subcommands of `jaxengine` (docs/LAB.md): calibrate, simulate, tune, workload, and
`bench --workload` (the real replay; `jaxengine bench` without it runs benchmarks/throughput.py).

Thin wrappers over `jaxengine.lab`: each parses its flags (engine flags from `jaxengine.flags`),
calls one lab function and prints or writes its result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from jaxengine import flags
from jaxengine.engine.args import EngineArgs
from jaxengine.lab import (
    bench,
    calibrate,
    cost_model,
    generators,
    results,
    simulate,
    trust,
    tune,
    workloads,
)
from jaxengine.lab.generators import SCENARIOS


def add_parsers(sub: Any) -> None:
    """The lab's subcommands (docs/LAB.md): calibrate, simulate, tune, workload."""
    cal = sub.add_parser("calibrate", help="time real steps, fit a step-time cost model",
                         description="Build an engine from the engine flags, time its steps "
                                     "over a grid of batch shapes, fit the cost model and write "
                                     "it (with the engine arguments and backend) to COST.json.")
    cal.add_argument("--output", required=True, metavar="COST.json", help="the cost model file")
    cal.add_argument("--repeats", type=int, default=1,
                     help="passes over the grid, alternating order, to average out other "
                          "load on the machine (default: 1)")
    cal.add_argument("--max-scene-tokens", type=int, default=4096,
                     help="most prompt tokens a scene of the grid prefills: higher widens the "
                          "grid to more requests at longer contexts (default: 4096)")
    flags.add_engine_flags(cal)
    sim = sub.add_parser("simulate", help="simulate a workload with the real scheduler",
                         description="Run WORKLOAD.json through the real scheduler on a "
                                     "virtual clock priced by COST.json (no weights loaded); "
                                     "engine flags override the cost model's arguments.")
    sim.add_argument("workload", metavar="WORKLOAD.json", help="the workload")
    sim.add_argument("--cost-model", required=True, metavar="COST.json",
                     help="from `jaxengine calibrate`")
    sim.add_argument("--output", metavar="OUT.json", help="where to write the results")
    sim.add_argument("--plot", metavar="PATH.png", help="draw the step timeline there")
    sim.add_argument("--compare", metavar="REAL.json",
                     help="a real run's results (`jaxengine bench --workload`): print the "
                          "simulation's relative errors against it")
    flags.add_engine_flags(sim)
    tune = sub.add_parser("tune", help="sweep engine settings in the simulator under an SLO",
                          description="Simulate WORKLOAD.json under a grid of scheduler "
                                      "settings, print the Pareto table of the configurations "
                                      "that meet the SLO and the flags it recommends.")
    tune.add_argument("workload", metavar="WORKLOAD.json", help="the workload")
    tune.add_argument("--cost-model", required=True, metavar="COST.json",
                      help="from `jaxengine calibrate`")
    tune.add_argument("--slo", default="", metavar="ttft_p99=S,tpot_p99=S",
                      help="latency limits in seconds, e.g. ttft_p99=2,tpot_p99=0.2 (metrics: "
                           "ttft, tpot, e2e, queue; percentiles p50, p90, p99)")
    tune.add_argument("--policies", default=None, metavar="POLICY,...",
                      help="the scheduling policies to sweep, registered names or "
                           "MODULE:CLASS (default: every registered one, a policy "
                           "--scheduling-policy MODULE:CLASS loads included)")
    tune.add_argument("--output", metavar="OUT.json", help="write every configuration's summary")
    tune.add_argument("--plot", metavar="PATH.png", help="draw the Pareto front there")
    flags.add_engine_flags(tune)
    wl = sub.add_parser("workload", help="write a generated workload (a named scenario)",
                        description="Write a workload of a named scenario (docs/LAB.md).")
    wl.add_argument("scenario", choices=SCENARIOS, help="the scenario")
    wl.add_argument("--output", required=True, metavar="WORKLOAD.json", help="the file to write")
    wl.add_argument("--num-requests", type=int, default=64, help="requests (default: 64)")
    wl.add_argument("--rate", type=float, default=float("inf"),
                    help="mean arrivals per second; inf: all at t=0 (default: inf)")
    wl.add_argument("--burst-size", type=int, default=1,
                    help="requests arriving together (default: 1, Poisson)")
    wl.add_argument("--scale", type=float, default=1.0,
                    help="multiplies every prompt and output length (default: 1)")
    wl.add_argument("--vocab-size", type=int, default=49152,
                    help="token ids are drawn below it (default: 49152, SmolLM2's)")
    wl.add_argument("--seed", type=int, default=0, help="seeds every draw (default: 0)")


def run_bench_workload(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`jaxengine bench --workload W.json [--output OUT.json] [engine flags]`: the real
    online replay; prints the summary."""
    workload = workloads.load_workload(ns.workload)
    result = bench.bench(workload, flags.engine_args_from(ns, parser))
    _report(result, ns.output, "real")
    return 0


def run_calibrate(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`jaxengine calibrate --output COST.json [engine flags]`: prints the fit's errors."""
    if ns.max_scene_tokens < 1:
        parser.error(f"--max-scene-tokens must be >= 1, got {ns.max_scene_tokens}")
    model = calibrate.calibrate(flags.engine_args_from(ns, parser), repeats=ns.repeats,
                                max_scene_tokens=ns.max_scene_tokens,
                                log=lambda m: print(m, file=sys.stderr, flush=True))
    cost_model.save_cost_model(model, ns.output)
    coefs = ", ".join(f"{k} {v:.3g}" for k, v in model.coefficients.items())
    print(f"cost model ({model.backend}, {model.device}): seconds per unit: {coefs}; "
          f"idle call {model.idle_call_seconds:.3g}")
    if model.fit is not None:
        f = model.fit
        print(f"held-out error over {f.held_out_points} calls (fit on {f.train_points}): "
              f"median {f.median_rel_error:.1%}, p90 {f.p90_rel_error:.1%}, "
              f"max {f.max_rel_error:.1%}")
    print(f"machine load (1-minute average): {trust.describe_load(model.info)}")
    print(f"wrote {ns.output}" + (" (it keeps the warning: simulate and tune repeat it)"
                                  if model.info["warnings"] else ""))
    return 0


def _lab_args(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Any, Any, Any]:
    """(workload, cost model, engine args: the cost model's, with the flags given); the cost
    model's warnings (a poor fit) are printed to stderr."""
    cost = cost_model.load_cost_model(ns.cost_model)
    for message in cost.info.get("warnings", ()):
        print(f"warning: {ns.cost_model}: {message}", file=sys.stderr)
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    given = {k: v for k, v in vars(ns).items() if k in names}
    return (workloads.load_workload(ns.workload), cost,
            simulate.simulation_args(cost, given))


def run_simulate(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`jaxengine simulate W.json --cost-model COST.json [--output OUT.json] [--plot P]`."""
    import time

    workload, cost, args = _lab_args(ns, parser)
    t0 = time.perf_counter()
    result = simulate.simulate(workload, cost, args)
    seconds = time.perf_counter() - t0
    print(f"simulated {len(result.steps)} steps in {seconds:.2f} s "
          f"({len(result.steps) / max(seconds, 1e-9):.0f} steps/s)", file=sys.stderr)
    _report(result, ns.output, "simulated")
    if ns.compare:
        real = results.load_result(ns.compare)
        errors = results.compare(result, real)
        print("simulated / real - 1: " + ", ".join(f"{k} {v:+.1%}" for k, v in errors.items()))
        for difference in trust.run_differences(result, real, cost):
            print(f"warning: {ns.compare} is not the run simulated: {difference}",
                  file=sys.stderr)
    if ns.plot:
        from jaxengine.lab import plots  # here: matplotlib comes with the `lab` extra

        plots.timeline(result.steps, x="time", title=f"simulated {ns.workload}", save=ns.plot)
        print(f"wrote {ns.plot}")
    return 0


def run_tune(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`jaxengine tune W.json --cost-model COST.json --slo ttft_p99=S,...`: the Pareto table
    and the recommended flags."""
    workload, cost, args = _lab_args(ns, parser)
    slo = tune.parse_slo(ns.slo)
    policies = None if ns.policies is None else [
        flags.policy_from_flag(p.strip()) for p in ns.policies.split(",") if p.strip()]
    report = tune.tune(workload, cost, args, slo=slo, policies=policies)
    print(tune.format_report(report))
    if ns.output:
        with open(ns.output, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    if ns.plot:
        tune.plot(report, ns.plot)
        print(f"wrote {ns.plot}")
    return 0


def run_workload(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`jaxengine workload SCENARIO --output W.json [...]`: write a generated workload."""
    w = generators.scenario(ns.scenario, num_requests=ns.num_requests, rate=ns.rate,
                            seed=ns.seed, vocab_size=ns.vocab_size, scale=ns.scale,
                            burst_size=ns.burst_size)
    workloads.save_workload(w, ns.output)
    print(f"wrote {ns.output}: {len(w.requests)} requests, last arrival "
          f"{w.last_arrival:.2f} s")
    return 0


def _report(result: Any, output: str | None, label: str) -> None:
    print(results.format_summary(result, label))
    if output:
        results.save_result(result, output)
        print(f"wrote {output}")


COMMANDS = {"bench": run_bench_workload, "calibrate": run_calibrate, "simulate": run_simulate,
            "tune": run_tune, "workload": run_workload}
