"""Offline throughput on a workload (docs/BENCHMARKS.md §2-3): tokens/s, TTFT/TPOT, compilations,
padding waste, and the step-time ratio of a x8 KV pool to a x1 pool.

    python benchmarks/throughput.py [--workload benchmarks/workloads/mix64.json] [--limit N]
        [--compare hf --hf-python .venv311/bin/python]

All requests arrive at t=0 (greedy, ignore_eos, exactly max_tokens each). The engine is
warmed up first (`precompile=True`), so every compilation during the run is a failure of the
bucketing. `--compare hf` runs HF transformers on the same GGUF weights, float32, in another
interpreter (a Python 3.11 venv with torch; this file doubles as its worker via `--hf-worker`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WORKLOAD = REPO / "benchmarks" / "workloads" / "mix64.json"


def load_workload(path: Path, limit: int | None) -> list[dict[str, Any]]:
    """The workload's requests (`prompt_token_ids`, `max_tokens`), the first `limit` of them."""
    with open(path) as f:
        data = json.load(f)
    requests = data["requests"] if isinstance(data, dict) else data
    return requests[:limit] if limit else requests


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of `values`; NaN if empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


# ---- the jaxengine side -------------------------------------------------------------------


def build_engine(fns: Any, tokenizer: Any, args: argparse.Namespace, num_blocks: int) -> Any:
    """An `LLMEngine` over already-loaded model functions, warmed up (every bucket compiled)."""
    from jaxengine.engine.args import EngineArgs
    from jaxengine.engine.llm_engine import LLMEngine

    engine_args = EngineArgs(max_num_seqs=args.max_num_seqs, block_size=args.block_size,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=args.max_model_len, num_gpu_blocks_override=num_blocks,
                             intermediate_token_buckets=not args.pow2_buckets, precompile=False)
    engine = LLMEngine(fns, engine_args, tokenizer=tokenizer, max_model_len=args.max_model_len,
                       num_blocks=num_blocks)
    engine.runner.precompile(progress=not args.quiet)
    return engine


def run_engine(engine: Any, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Run every request to the end; return timings and counters."""
    from scheduler import SamplingParams

    stats = engine.runner.stats
    steps_before, padded_before, computed_before = stats.steps, stats.padded_tokens, \
        stats.computed_tokens
    start = time.time()
    for r in requests:
        params = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
        engine.add_request(r["id"], {"prompt_token_ids": r["prompt_token_ids"]}, params,
                           arrival_time=start)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    elapsed = time.time() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in finished)
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    return dict(
        elapsed=elapsed, output_tokens=out_tokens, prompt_tokens=prompt_tokens,
        ttft=[o.metrics.ttft for o in finished if o.metrics.ttft is not None],
        tpot=[o.metrics.tpot for o in finished if o.metrics.tpot is not None],
        steps=stats.steps - steps_before,
        padding_waste=(stats.padded_tokens - padded_before)
        / max(stats.computed_tokens - computed_before, 1),
        outputs={o.request_id: list(o.outputs[0].token_ids) for o in finished},
    )


def jaxengine_side(args: argparse.Namespace, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Load the model once; run the workload on a x1 and a x8 KV pool."""
    from jaxengine.engine.args import EngineArgs
    from jaxengine.engine.build import attention_backend, model_fns
    from jaxengine.loading.load import load_model

    t0 = time.time()
    model, cfg, tokenizer = load_model(args.model, dtype=args.dtype)
    backend = attention_backend(EngineArgs(block_size=args.block_size), cfg)
    fns = model_fns(model, cfg, attn_impl=backend)
    print(f"model loaded in {time.time() - t0:.1f}s", file=sys.stderr)
    results = {}
    for factor in (1, 8) if not args.skip_pool_ratio else (1,):
        t0 = time.time()
        engine = build_engine(fns, tokenizer, args, args.num_blocks * factor)
        warmup = time.time() - t0
        res = run_engine(engine, requests)
        res.update(warmup=warmup, compilations=engine.runner.stats.compilations,
                   buckets=engine.runner.token_buckets,
                   after_warmup=engine.runner.stats.compilations_after_warmup)
        results[factor] = res
        del engine
    return results


# ---- the transformers side (runs under --hf-python) ---------------------------------------


def hf_worker(args: argparse.Namespace) -> None:
    """Run the workload with transformers; print one JSON line of results."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    requests = load_workload(Path(args.workload), args.limit)
    folder, fname = os.path.split(args.gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname,
                                                 dtype=torch.float32).eval()
    result: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    config = GenerationConfig(do_sample=False, max_new_tokens=max(r["max_tokens"] for r in
                                                                  requests))
    try:
        result["cb"] = _hf_continuous_batching(model, config, requests)
    except Exception as e:  # report and go on: the static-batch figure is still useful
        result["cb_error"] = f"{type(e).__name__}: {e}"
    result["static8"] = _hf_static_batches(model, requests, batch_size=8)
    print("HF_RESULT " + json.dumps(result))


def _hf_continuous_batching(model: Any, config: Any, requests: list[dict[str, Any]]
                            ) -> dict[str, Any]:
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    start = time.time()
    try:
        for r in requests:
            manager.add_request(r["prompt_token_ids"], request_id=r["id"],
                                max_new_tokens=r["max_tokens"], eos_token_id=-1)
        tokens, done = 0, set()
        while len(done) < len(requests):
            out = manager.get_result(timeout=600)
            if out is None:
                raise RuntimeError("continuous batching stopped before finishing")
            if out.is_finished() and out.request_id not in done:
                done.add(out.request_id)
                tokens += len(out.generated_tokens)
    finally:
        manager.stop(block=True)
    elapsed = time.time() - start
    return {"elapsed": elapsed, "output_tokens": tokens}


def _hf_static_batches(model: Any, requests: list[dict[str, Any]], batch_size: int
                       ) -> dict[str, Any]:
    import torch

    start, tokens = time.time(), 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r["prompt_token_ids"]) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, r in enumerate(batch):
            p = r["prompt_token_ids"]
            ids[b, width - len(p):] = torch.tensor(p)
            mask[b, width - len(p):] = 1
        n = max(r["max_tokens"] for r in batch)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)
        tokens += sum(r["max_tokens"] for r in batch)  # useful tokens only
    return {"elapsed": time.time() - start, "output_tokens": tokens}


def run_hf(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run `hf_worker` under `--hf-python`; its parsed result, or None on failure."""
    from jaxengine.loading.load import default_model_path

    gguf = args.model if args.model and args.model.endswith(".gguf") else default_model_path()
    cmd = [args.hf_python, __file__, "--hf-worker", "--gguf", gguf, "--workload",
           str(args.workload)] + (["--limit", str(args.limit)] if args.limit else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("HF_RESULT "):
            return json.loads(line[len("HF_RESULT "):])
    print(f"transformers side failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}",
          file=sys.stderr)
    return None


# ---- report -------------------------------------------------------------------------------


def report(results: dict[int, dict[str, Any]], hf: dict[str, Any] | None) -> None:
    """Print the table and the one-line summary."""
    r = results[1]
    tps = r["output_tokens"] / r["elapsed"]
    rows = [
        ("requests / steps", f"{len(r['outputs'])} / {r['steps']}"),
        ("output tokens/s", f"{tps:.1f}"),
        ("total tokens/s", f"{(r['output_tokens'] + r['prompt_tokens']) / r['elapsed']:.1f}"),
        ("TTFT p50 / p99 (s)",
         f"{percentile(r['ttft'], 50):.2f} / {percentile(r['ttft'], 99):.2f}"),
        ("TPOT p50 / p99 (ms)",
         f"{1e3 * percentile(r['tpot'], 50):.0f} / {1e3 * percentile(r['tpot'], 99):.0f}"),
        ("compilations (warm-up) / after", f"{r['compilations']} / {r['after_warmup']}"),
        ("padding waste", f"{100 * r['padding_waste']:.1f}%"),
        ("token buckets", " ".join(map(str, r["buckets"]))),
        ("peak RSS", f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"),
    ]
    ratio = None
    if 8 in results:
        ratio = results[8]["elapsed"] / r["elapsed"]
        same = results[8]["outputs"] == r["outputs"]
        rows.append(("x8 / x1 pool time (same outputs)", f"{ratio:.2f} ({same})"))
    summary = f"jaxengine {tps:.1f} out tok/s"
    if hf is not None:
        for key, name in (("cb", "transformers continuous batching"),
                          ("static8", "transformers generate, batches of 8")):
            if key in hf:
                hf_tps = hf[key]["output_tokens"] / hf[key]["elapsed"]
                rows.append((f"{name} tok/s", f"{hf_tps:.1f} (x{tps / hf_tps:.2f})"))
                summary += f"; {tps / hf_tps:.2f}x {key}"
        if "cb_error" in hf:
            rows.append(("transformers continuous batching", hf["cb_error"][:80]))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    extra = f", pool ratio {ratio:.2f}" if ratio is not None else ""
    print(f"SUMMARY: {summary}, {r['after_warmup']} compilations after warm-up, padding "
          f"{100 * r['padding_waste']:.1f}%{extra}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    p.add_argument("--limit", type=int, default=None, help="run the first N requests")
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=1024, help="KV pages of the x1 pool")
    p.add_argument("--pow2-buckets", action="store_true",
                   help="powers of two only (default adds 1.5x buckets: less padding)")
    p.add_argument("--skip-pool-ratio", action="store_true", help="skip the x8 pool run")
    p.add_argument("--compare", choices=["hf"], default=None)
    p.add_argument("--hf-python", default=str(REPO / ".venv311" / "bin" / "python"))
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gguf", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = parse_args(argv)
    if args.hf_worker:
        hf_worker(args)
        return 0
    sys.path.insert(0, str(REPO))
    requests = load_workload(args.workload, args.limit)
    results = jaxengine_side(args, requests)
    hf = run_hf(args) if args.compare == "hf" else None
    report(results, hf)
    return 0


if __name__ == "__main__":
    sys.exit(main())
