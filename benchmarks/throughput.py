"""Offline throughput as a user runs it (docs/BENCHMARKS.md §2-3): jaxengine with `LLM()`'s
defaults beside transformers' continuous batching, the share of the CPU's FLOP roofline,
compilations, padding, and optionally sync against async scheduling and a x8 KV pool. The
report opens with the CPU kernels' path (`$JAXENGINE_CPU_ISA`) and the CPU's model.

    python benchmarks/throughput.py [--workload benchmarks/workloads/mix64.json] [--limits 16,64]
        [--compare hf --hf-python .venv311/bin/python] [--async-compare] [--pool-ratio]
        [--baseline-buckets 1,2,3,... | --baseline-attention reference | --baseline-xla-dots
         | --baseline-batch-invariant]
        [--attention-free]
        [--step-times]
        [--max-num-seqs N ...]   # engine overrides; default: EngineArgs' own defaults

All requests arrive at t=0 (greedy, ignore_eos, exactly max_tokens each). The engine is built
as `LLM(dtype=...)` builds it (`EngineArgs` defaults, the KV pool from the memory budget) and
warmed up first, so every compilation during a run is a failure of the bucketing. Each limit
(the first N requests) runs on the same warm engine. `--compare hf` runs HF transformers on the
same GGUF weights, float32, in another interpreter (a Python 3.11 venv with torch, running
`benchmarks/hf_baseline.py`), on the same limits.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from report import report  # this folder: the printed tables
from roofline import sgemm_rate, useful_flops  # this folder: the roofline's two halves

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WORKLOAD = REPO / "benchmarks" / "workloads" / "mix64.json"
HF_WORKER = Path(__file__).with_name("hf_baseline.py")  # the transformers side, own interpreter
# Engine settings a flag may override; None keeps EngineArgs' default (what LLM() uses).
OVERRIDES = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
             "num_gpu_blocks_override")


def load_workload(path: Path, limit: int | None) -> list[dict[str, Any]]:
    """The workload's requests (`prompt_token_ids`, `max_tokens`), the first `limit` of them."""
    with open(path) as f:
        data = json.load(f)
    requests = data["requests"] if isinstance(data, dict) else data
    return requests[:limit] if limit else requests


# ---- the jaxengine side -------------------------------------------------------------------


def cpu_kernels() -> str:
    """The native CPU kernels' path, as the loaded library reports it ($JAXENGINE_CPU_ISA picks
    it), and the CPU's model name: "avx512 (16-float vectors, int8 in bfloat16 pairs),
    <model name>" (the pairs where the build has AVX512-BF16); or why the kernels do not run.
    Timings of different paths or CPUs do not compare."""
    from jaxengine_kernels.cpu import native

    why = native.available()
    pairs = ", int8 in bfloat16 pairs" if not why and native.int8_pairs() else ""
    path = (f"unavailable ({why})" if why else
            f"{native.isa()} ({native.vector_lanes()}-float vectors{pairs})")
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next(ln.partition(":")[2].strip() for ln in lines if ln.startswith("model name"))
    except (OSError, StopIteration):  # no /proc/cpuinfo, or a CPU that names no model there
        model = platform.processor() or platform.machine()
    return f"{path}, {model}"


def engine_args(args: argparse.Namespace, **extra: Any) -> Any:
    """`EngineArgs` as `LLM(dtype=...)` gets them, with the command line's overrides."""
    from jaxengine.engine.args import EngineArgs

    given = {k: getattr(args, k) for k in OVERRIDES if getattr(args, k) is not None}
    return EngineArgs(model=args.model, dtype=args.dtype, precompile=False, **given, **extra)


def stub_attention() -> None:
    """`--attention-free`: every attention implementation becomes a stub that writes the new K/V
    into the cache and returns q. The outputs are garbage but the steps are the workload's
    (every request ignores EOS and stops at max_tokens; mix64 shares no prefix), so the run's
    roofline share bounds what any attention kernel could reach with the rest of the engine
    (matmuls, norms, sampling, the loop) as it is."""
    from jaxengine_kernels import attention
    from jaxengine_kernels.reference import write_kv

    def stub(q: Any, k: Any, v: Any, kv_cache: Any, slot_mapping: Any, *rest: Any,
             **kwargs: Any) -> tuple[Any, Any]:
        return q, write_kv(kv_cache, k, v, slot_mapping)

    attention.ragged_paged_attention_reference = stub
    attention._KERNELS = dict.fromkeys(attention._KERNELS, stub)


def load(args: argparse.Namespace, attention: str | None = None, pack: bool = True,
         batch_invariant: bool = False) -> tuple[Any, Any, Any]:
    """The model's functions, config and tokenizer, loaded once as `build_engine` does (with
    `attention`, that attention backend instead of the engine's default; without `pack`, the
    projections as XLA dots where the engine would pack them for the native CPU matmul; with
    `batch_invariant`, in the engine's batch-invariant mode)."""
    from jaxengine.engine.build import attention_backend, model_fns
    from jaxengine.loading.load import load_model
    from jaxengine.model.mesh import engine_devices, make_mesh

    if args.attention_free:
        stub_attention()
    ea = engine_args(args, **({"attention_backend": attention} if attention else {}))
    model, cfg, tokenizer = load_model(ea.model, dtype=ea.dtype, mesh=make_mesh(
        engine_devices(1)))
    fns = model_fns(model, cfg, attn_impl=attention_backend(ea, cfg), pack=pack,
                    batch_invariant=batch_invariant)
    return fns, cfg, tokenizer


def build_engine(fns: Any, cfg: Any, tokenizer: Any, ea: Any, *, buckets: tuple[int, ...]
                 | None = None, progress: bool = True, precompile: bool = True
                 ) -> tuple[Any, float]:
    """An `LLMEngine` built as `jaxengine.engine.build.build_engine` builds it over loaded
    functions, warmed up (every bucket compiled); and the warm-up's seconds.

    `buckets` replaces the runner's token buckets (to compare bucket sets in one run). With
    `precompile=False` the engine is only declared warm: an engine of the same shapes over the
    same functions was warmed up before, and jit's cache holds its programs.
    """
    from jaxengine.engine.build import resolve_config
    from jaxengine.engine.llm_engine import LLMEngine
    from jaxengine.runner.compilation_cache import configure

    configure(ea.compilation_cache_dir)
    engine = LLMEngine(fns, ea, resolve_config(ea, fns, cfg), tokenizer=tokenizer)
    if buckets is not None:
        engine.runner.token_buckets = buckets
    t0 = time.perf_counter()
    if precompile:
        engine.runner.precompile(progress=progress)
    else:
        engine.runner.mark_warm()
    return engine, time.perf_counter() - t0


def add_requests(engine: Any, requests: list[dict[str, Any]], start: float) -> None:
    """The workload's requests, all arriving at `start`: greedy, exactly max_tokens each."""
    from scheduler import SamplingParams

    for r in requests:
        params = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
        engine.add_request(r["id"], {"prompt_token_ids": r["prompt_token_ids"]}, params,
                           arrival_time=start)


def run_engine(engine: Any, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Run every request to the end; return timings and counters."""
    stats = engine.runner.stats
    before = (stats.steps, stats.padded_tokens, stats.computed_tokens,
              stats.compilations_after_warmup)
    start, cpu = time.time(), time.process_time()
    add_requests(engine, requests, start)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    elapsed = time.time() - start
    return dict(
        elapsed=elapsed, cpu=time.process_time() - cpu,
        output_tokens=sum(len(o.outputs[0].token_ids) for o in finished),
        prompt_tokens=sum(len(r["prompt_token_ids"]) for r in requests),
        ttft=[o.metrics.ttft for o in finished if o.metrics.ttft is not None],
        tpot=[o.metrics.tpot for o in finished if o.metrics.tpot is not None],
        steps=stats.steps - before[0],
        padding_waste=(stats.padded_tokens - before[1]) / max(stats.computed_tokens - before[2],
                                                              1),
        after_warmup=stats.compilations_after_warmup - before[3],
        outputs={o.request_id: list(o.outputs[0].token_ids) for o in finished},
    )


def step_times(args: argparse.Namespace, loaded: tuple[Any, Any, Any],
               requests: list[dict[str, Any]]) -> dict[int, list[tuple[float, int]]]:
    """`--step-times`: the requests once more with async scheduling off, so that each
    `step()` is one model step whose time is its own (schedule, pack, device, update); per
    token bucket, the (seconds, scheduled tokens) of each of its steps."""
    fns, cfg, tokenizer = loaded
    # The same programs as the async engine's, already compiled.
    ea = engine_args(args, async_scheduling=False, skip_tokenizer_init=tokenizer is None)
    engine, _ = build_engine(fns, cfg, tokenizer, ea, buckets=args.token_buckets,
                             progress=False, precompile=False)
    add_requests(engine, requests, time.time())
    stats, steps = engine.runner.stats, collections.defaultdict(list)
    while engine.has_unfinished_requests():
        real, padded, t0 = stats.computed_tokens, stats.padded_tokens, time.perf_counter()
        engine.step()
        real, padded = stats.computed_tokens - real, stats.padded_tokens - padded
        if real:  # a step that ran the model (its bucket: real + padded tokens)
            steps[real + padded].append((time.perf_counter() - t0, real))
    return dict(sorted(steps.items()))


# ---- sync against async scheduling ---------------------------------------------------------


def tiny_model(vocab_size: int) -> tuple[Any, Any]:
    """A random 2-layer model of width 32 over the workload's vocabulary: host-bound steps."""
    from jaxengine.engine.build import model_fns
    from jaxengine.model.config import ModelConfig
    from jaxengine.model.decoder import Model

    cfg = ModelConfig.tiny(vocab_size=vocab_size, max_position_embeddings=4096)
    return model_fns(Model(cfg), cfg, attn_impl="reference"), cfg


def async_compare(args: argparse.Namespace, loaded: tuple[Any, Any, Any],
                  requests: list[dict[str, Any]]) -> list[tuple[str, dict, dict]]:
    """The same requests with async_scheduling False then True, on the loaded model (its
    first `--async-limit` requests) and on a tiny random one (all); (name, sync, async)."""
    fns, cfg, tokenizer = loaded
    tiny_fns, tiny_cfg = tiny_model(cfg.vocab_size)
    # (name, functions, config, tokenizer, requests, token buckets, compiled already)
    cases = [(f"default model, {args.async_limit} requests", fns, cfg, tokenizer,
              requests[:args.async_limit], args.token_buckets, True),
             (f"tiny random model, {len(requests)} requests", tiny_fns, tiny_cfg, None,
              requests, None, False)]
    out = []
    for name, f, c, tok, reqs, buckets, compiled in cases:
        runs = {}
        for mode in (False, True):  # sync and async share every program
            ea = engine_args(args, async_scheduling=mode, skip_tokenizer_init=tok is None)
            engine, _ = build_engine(f, c, tok, ea, buckets=buckets, progress=False,
                                     precompile=not (compiled or mode))
            runs[mode] = run_engine(engine, reqs)
            del engine
        out.append((name, runs[False], runs[True]))
    return out


# ---- the transformers side ------------------------------------------------------------------


def run_hf(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run `hf_baseline.py` under `--hf-python`; its parsed result, or None on failure."""
    from jaxengine.loading.load import default_model_path

    gguf = args.model if args.model and args.model.endswith(".gguf") else default_model_path()
    cmd = [args.hf_python, str(HF_WORKER), "--gguf", gguf, "--workload",
           str(args.workload), "--limits", args.limits] + (["--hf-static"] if args.hf_static
                                                           else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("HF_RESULT "):
            return json.loads(line[len("HF_RESULT "):])
    print(f"transformers side failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}",
          file=sys.stderr)
    return None


def parse_limits(text: str) -> list[int | None]:
    """`--limits` as request counts; 0 means all."""
    return [int(x) or None for x in text.split(",")]


def run_baseline(args: argparse.Namespace, loaded: tuple[Any, Any, Any], ea: Any,
                 setup: dict[str, Any], requests: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The requests on the baseline engine: `--baseline-buckets` and / or the model with
    `--baseline-attention`, `--baseline-xla-dots` or `--baseline-batch-invariant` (loaded once,
    into `setup`); None without any of them."""
    other_model = (args.baseline_attention or args.baseline_xla_dots
                   or args.baseline_batch_invariant)
    if not (args.baseline_buckets or other_model):
        return None
    if other_model and "baseline_fns" not in setup:
        setup["baseline_fns"] = load(args, attention=args.baseline_attention,
                                     pack=not args.baseline_xla_dots,
                                     batch_invariant=args.baseline_batch_invariant)
    if args.baseline_batch_invariant:
        ea = dataclasses.replace(ea, batch_invariant=True)
    fns, cfg, tokenizer = setup.get("baseline_fns", loaded)
    buckets = args.baseline_buckets or args.token_buckets
    compiled = not other_model and set(buckets or setup["buckets"]) <= set(setup["buckets"])
    engine, _ = build_engine(fns, cfg, tokenizer, ea, buckets=buckets, progress=False,
                             precompile=not compiled)
    return run_engine(engine, requests)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    p.add_argument("--limits", default="16,0",
                   help="comma-separated request counts to run (first N; 0: all)")
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    for name in OVERRIDES:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help="engine override (default: EngineArgs' default)")
    p.add_argument("--token-buckets", default=None,
                   help="comma-separated token buckets replacing the engine's (e.g. 16,32,...)")
    p.add_argument("--baseline-buckets", default=None,
                   help="also run each limit with these token buckets, side by side")
    p.add_argument("--baseline-attention", default=None,
                   choices=["reference", "cpu", "tpu", "gpu"],
                   help="also run each limit with this attention backend, side by side")
    p.add_argument("--baseline-xla-dots", action="store_true",
                   help="also run each limit with the projections as XLA dots (not packed for "
                        "the native CPU matmul), side by side")
    p.add_argument("--baseline-batch-invariant", action="store_true",
                   help="also run each limit with batch_invariant=True, side by side")
    p.add_argument("--pool-ratio", action="store_true",
                   help="run the largest limit again on a x8 KV pool (docs/BENCHMARKS.md §3)")
    p.add_argument("--step-times", action="store_true",
                   help="run the largest limit again with async scheduling off and time "
                        "every step, by token bucket")
    p.add_argument("--async-compare", action="store_true",
                   help="async_scheduling False vs True, default and tiny model")
    p.add_argument("--async-limit", type=int, default=16,
                   help="requests of the default model's sync/async runs")
    p.add_argument("--compare", choices=["hf"], default=None)
    p.add_argument("--hf-static", action="store_true", help="also HF generate, batches of 8")
    p.add_argument("--hf-python", default=str(REPO / ".venv311" / "bin" / "python"))
    p.add_argument("--attention-free", action="store_true",
                   help="attention replaced by a stub (garbage outputs): the roofline share "
                        "the rest of the engine allows")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    try:
        parse_limits(args.limits)
        for name in ("token_buckets", "baseline_buckets"):
            if getattr(args, name):
                setattr(args, name, tuple(int(x) for x in getattr(args, name).split(",")))
    except ValueError:
        p.error("--limits and --token-buckets take comma-separated integers, e.g. 16,0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    setup: dict[str, Any] = {"load": " ".join(f"{x:.1f}" for x in os.getloadavg())}
    loaded = load(args)
    setup["cpu"] = cpu_kernels()
    fns, cfg, tokenizer = loaded
    ea = engine_args(args)
    engine, setup["warmup"] = build_engine(fns, cfg, tokenizer, ea, buckets=args.token_buckets,
                                           progress=not args.quiet)
    rc = engine.runner.config
    setup.update(buckets=engine.runner.token_buckets, sgemm=sgemm_rate(), engine=(
        f"max_num_seqs={rc.max_num_seqs} budget={rc.max_num_batched_tokens} "
        f"max_model_len={rc.max_model_len} blocks={rc.num_blocks} "
        f"async_scheduling={ea.async_scheduling}"))
    runs, flops = {}, {}
    for i, limit in enumerate(parse_limits(args.limits)):
        requests = load_workload(args.workload, limit)
        # The baseline runs before the measured engine on every other limit, so a drift in the
        # machine's load does not favour one side.
        baseline = run_baseline(args, loaded, ea, setup, requests) if i % 2 else None
        # A fresh engine each time (the programs compiled once): no prefix-cache hits on the
        # prompts of an earlier limit.
        engine = engine or build_engine(fns, cfg, tokenizer, ea, buckets=args.token_buckets,
                                        precompile=False)[0]
        runs[len(requests)] = run_engine(engine, requests)
        flops[len(requests)] = useful_flops(cfg, requests)
        engine = None
        baseline = baseline or run_baseline(args, loaded, ea, setup, requests)
        if baseline is not None:
            runs[len(requests)]["baseline"] = baseline
    pool = None
    if args.pool_ratio:
        requests = load_workload(args.workload, max(runs))
        big = engine_args(args, num_gpu_blocks_override=8 * rc.num_blocks)
        engine, _ = build_engine(fns, cfg, tokenizer, big, buckets=args.token_buckets,
                                 progress=False)
        r8 = run_engine(engine, requests)
        del engine
        pool = (r8["elapsed"] / runs[max(runs)]["elapsed"], r8["outputs"] ==
                runs[max(runs)]["outputs"])
    # The roofline is the best the machine did: the rate once more after the runs (a neighbour
    # or the warm-up's leftovers slowed the first measurement by up to a third here).
    setup["sgemm"] = {k: max(v, setup["sgemm"][k]) for k, v in sgemm_rate().items()}
    asyncs = async_compare(args, loaded, load_workload(args.workload, None)) \
        if args.async_compare else []
    steps = step_times(args, loaded, load_workload(args.workload, max(runs))) \
        if args.step_times else {}
    hf = run_hf(args) if args.compare == "hf" else None
    report(args, setup, runs, flops, hf, asyncs, pool, steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
