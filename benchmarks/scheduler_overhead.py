"""Scheduler host overhead per step (docs/BENCHMARKS.md §1).

Times `schedule()` + `update_from_output()` per step with a fake model (every request whose
prompt is complete samples token 7, EOS ignored) on seeded synthetic traces:

    python benchmarks/scheduler_overhead.py [--traces ample,tight,...] [--requests 1000]
        [--policy srpf]

Prints mean / p50 / p99 microseconds per step, wall clock and this process's CPU time (the CPU
figure is robust to other processes on a shared machine), and CPU per scheduled request, of the
median of `--repeat` runs per trace, then a one-line summary against vLLM's V1 scheduler
reference point here (3-5 ms per step). `--policy` runs every trace under one scheduling policy
(default: each trace's own, `priority` for the priority trace and `fcfs` for the others), e.g. a
dynamic one (docs/SCHEDULING.md §8) to see what re-sorting `waiting` every step costs. The
`backlog` trace, not in the default set, keeps a long `waiting` for that: every request arrives
at step 0 with prompts U[32, 512], outputs U[16, 64], tenants t0..t3 in turn and every other
prompt starting with one common 256-token prefix (prefix caching on), `max_num_seqs=64`.
"""

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler import (  # noqa: E402
    POLICIES,
    Request,
    SamplingParams,
    SchedulerConfig,
    add_request,
    init_state,
    schedule,
    update_from_output,
)

VLLM_MS_PER_STEP = (3.0, 5.0)  # docs/BENCHMARKS.md §1, vLLM 0.32 here


@dataclass(frozen=True)
class Trace:
    name: str
    config: SchedulerConfig
    arrivals: dict[int, list[Request]]


def make_trace(name: str, num_requests: int, seed: int = 0, policy: str | None = None) -> Trace:
    """The synthetic traces of docs/BENCHMARKS.md §1 (`policy` overrides the trace's own)."""
    rng = random.Random(seed)
    blocks = 16_000 if name in ("tight", "priority") else 200_000
    backlog = name == "backlog"
    config = SchedulerConfig(
        max_num_batched_tokens=8192, max_num_seqs=64 if backlog else 256, max_model_len=4096,
        block_size=16, num_blocks=blocks, enable_prefix_caching=name in ("prefix", "backlog"),
        policy=policy or ("priority" if name == "priority" else "fcfs"),
    )
    prefix = [rng.randrange(50_000) for _ in range(512)]
    arrivals: dict[int, list[Request]] = {}
    count = 256 if name == "decode256" else num_requests
    for i in range(count):
        if name == "decode256":
            prompt_len, output_len, step = 16, 1000, 0
        elif backlog:
            prompt_len, output_len, step = rng.randint(32, 512), rng.randint(16, 64), 0
        else:
            prompt_len, output_len = rng.randint(32, 2048), rng.randint(16, 512)
            step = rng.randrange(200)
        prompt = [rng.randrange(50_000) for _ in range(prompt_len)]
        if name == "prefix" and i % 2 == 0:
            prompt = (prefix + prompt)[:max(prompt_len, 513)]
        if backlog and i % 2 == 0:
            prompt = prefix[:256] + prompt
        arrivals.setdefault(step, []).append(Request(
            request_id=f"r{i}", prompt_token_ids=tuple(prompt),
            sampling_params=SamplingParams(max_tokens=output_len, ignore_eos=True),
            arrival_time=step + 1e-6 * i,
            priority=rng.randrange(4) if name == "priority" else 0,
            metadata={"tenant": f"t{i % 4}"} if backlog else {},
        ))
    return Trace(name, config, arrivals)


def run(trace: Trace) -> dict:
    """Drive the trace to the end; return per-step timings (ns) and counts."""
    state = init_state(trace.config)
    step_ns, cpu_ns, scheduled, preemptions = [], [], 0, 0
    last = max(trace.arrivals)
    step = 0
    while step <= last or state.requests:
        for r in trace.arrivals.get(step, ()):
            state = add_request(state, r)
        t0, c0 = time.perf_counter_ns(), time.process_time_ns()
        state, out = schedule(state)
        t1, c1 = time.perf_counter_ns(), time.process_time_ns()
        sampled = {rid: (7,) for rid in out.sampling_req_ids}  # the fake model: not timed
        t2, c2 = time.perf_counter_ns(), time.process_time_ns()
        state, _ = update_from_output(state, out, sampled)
        cpu_ns.append(time.process_time_ns() - c2 + c1 - c0)
        step_ns.append(time.perf_counter_ns() - t2 + t1 - t0)
        scheduled += len(out.num_scheduled_tokens)
        preemptions += len(out.preempted_req_ids)
        step += 1
    return {"step_ns": step_ns, "cpu_ns": cpu_ns, "scheduled": scheduled,
            "preemptions": preemptions, "hits": state.stats.prefix_cache_hits}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", default="ample,tight,prefix,priority,decode256")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", choices=sorted(POLICIES),
                        help="run every trace under this policy instead of its own")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs per trace; the run with the median mean CPU time is shown")
    args = parser.parse_args()
    print(f"{'trace':<10} {'steps':>6} {'wall mean':>9} {'p50':>6} {'p99':>6} {'cpu mean':>9} "
          f"{'p50':>6} {'p99':>6} {'cpu/req':>7} {'preempt':>7} {'hit tok':>8}   (us)")
    worst_wall = worst_cpu = 0.0
    for name in args.traces.split(","):
        trace = make_trace(name, args.requests, args.seed, args.policy)
        runs = sorted((run(trace) for _ in range(args.repeat)),
                      key=lambda r: statistics.fmean(r["cpu_ns"]))
        result = runs[len(runs) // 2]
        wall = [t / 1000 for t in result["step_ns"]]
        cpu = [t / 1000 for t in result["cpu_ns"]]
        qw, qc = statistics.quantiles(wall, n=100), statistics.quantiles(cpu, n=100)
        worst_wall = max(worst_wall, statistics.fmean(wall))
        worst_cpu = max(worst_cpu, statistics.fmean(cpu))
        print(f"{name:<10} {len(wall):>6} {statistics.fmean(wall):>9.0f} {qw[49]:>6.0f} "
              f"{qw[98]:>6.0f} {statistics.fmean(cpu):>9.0f} {qc[49]:>6.0f} {qc[98]:>6.0f} "
              f"{sum(cpu) / max(1, result['scheduled']):>7.2f} {result['preemptions']:>7} "
              f"{result['hits']:>8}")
    lo, hi = VLLM_MS_PER_STEP
    print(f"summary: worst trace mean {worst_cpu / 1000:.3f} ms/step of CPU "
          f"({worst_wall / 1000:.3f} ms wall) = {worst_cpu / 1000 / lo:.2f}x of vLLM's "
          f"{lo:.0f}-{hi:.0f} ms/step reference (target <= 0.2x, docs/BENCHMARKS.md §1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
