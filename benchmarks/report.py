"""The tables and the summary line `benchmarks/throughput.py` prints (docs/BENCHMARKS.md §2):
per limit its throughput, latencies, padding, compilations, useful FLOPs and roofline share,
the side-by-side baselines and transformers; then the sync/async, pool and step-time rows."""

from __future__ import annotations

import argparse
import resource
from typing import Any


def tokens_per_s(res: dict[str, Any]) -> float:
    """Output tokens per second of one run."""
    return res["output_tokens"] / res["elapsed"]


def print_table(rows: list[tuple[str, str]]) -> None:
    """Two aligned columns."""
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def baseline_name(args: argparse.Namespace) -> str:
    """What the baseline engine changes: its buckets, attention backend, dots and / or
    batch invariance."""
    parts = (["buckets"] if args.baseline_buckets else []) + (
        [f"attention {args.baseline_attention}"] if args.baseline_attention else []) + (
        ["XLA dots"] if args.baseline_xla_dots else []) + (
        ["batch-invariant"] if args.baseline_batch_invariant else [])
    return ", ".join(parts)


def run_rows(n: int, r: dict[str, Any], flops: dict[str, float], rate: float,
             hf: dict[str, Any] | None, args: argparse.Namespace
             ) -> tuple[list[tuple[str, str]], str]:
    """Table rows of one limit, and its part of the summary line."""
    # The lab's, imported here: hf_baseline.py's interpreter imports throughput.py, hence this
    # file, and has no jaxengine.
    from jaxengine.lab.results import percentile

    tps = tokens_per_s(r)
    roof = flops["total"] / (r["elapsed"] * rate)
    rows = [
        (f"[{n} requests] steps", str(r["steps"])),
        ("  output / total tokens/s",
         f"{tps:.1f} / {(r['output_tokens'] + r['prompt_tokens']) / r['elapsed']:.1f}"),
        ("  TTFT p50 / p99 (s)",
         f"{percentile(r['ttft'], 50):.2f} / {percentile(r['ttft'], 99):.2f}"),
        ("  TPOT p50 / p99 (ms)",
         f"{1e3 * percentile(r['tpot'], 50):.0f} / {1e3 * percentile(r['tpot'], 99):.0f}"),
        ("  padding waste", f"{100 * r['padding_waste']:.1f}%"),
        ("  compilations during the run", str(r["after_warmup"])),
        ("  useful GFLOP (matmul+head+attn)",
         f"{flops['total'] / 1e9:.0f} ({flops['matmul'] / 1e9:.0f}+{flops['head'] / 1e9:.0f}"
         f"+{flops['attention'] / 1e9:.0f})"),
        ("  roofline share", f"{100 * roof:.1f}% (of {rate / 1e9:.0f} GFLOP/s)"),
    ]
    summary = f"{n} req: {tps:.1f} tok/s, {100 * roof:.0f}% roofline"
    if "baseline" in r:
        b = r["baseline"]
        # CPU seconds (every thread's) beside the wall time: on a busy machine they move less.
        rows.append((f"  baseline ({baseline_name(args)}): tok/s, padding, CPU s",
                     f"{tokens_per_s(b):.1f}, {100 * b['padding_waste']:.1f}%, "
                     f"{b['cpu']:.1f} (this run x{tps / tokens_per_s(b):.2f}, {r['cpu']:.1f} "
                     f"CPU s; same outputs: {b['outputs'] == r['outputs']})"))
        summary += f", x{tps / tokens_per_s(b):.2f} baseline ({baseline_name(args)})"
    cb = (hf or {}).get("limits", {}).get(str(n), {})
    for key, name in (("cb", "transformers continuous batching"),
                      ("static8", "transformers generate, batches of 8")):
        if key in cb:
            hf_tps = cb[key]["output_tokens"] / cb[key]["elapsed"]
            rows.append((f"  {name} tok/s", f"{hf_tps:.1f} (jaxengine x{tps / hf_tps:.2f})"))
            summary += f", x{tps / hf_tps:.2f} {key}"
    if "cb_error" in cb:
        rows.append(("  transformers continuous batching", cb["cb_error"][:80]))
    return rows, summary


def report(args: argparse.Namespace, setup: dict[str, Any], runs: dict[int, dict[str, Any]],
           flops: dict[int, dict[str, float]], hf: dict[str, Any] | None,
           asyncs: list[tuple[str, dict, dict]], pool: tuple[float, bool] | None,
           steps: dict[int, list[tuple[float, int]]]) -> None:
    """Print the tables and the one-line summary."""
    rate = max(setup["sgemm"].values())
    rows = [
        ("CPU kernels", setup["cpu"]),
        ("engine", setup["engine"]),
        ("token buckets", " ".join(map(str, setup["buckets"]))),
        ("warm-up (compile every bucket)", f"{setup['warmup']:.1f} s"),
        ("sgemm rate jax / numpy (2048^2 f32, best of before and after the runs)",
         " / ".join(f"{v / 1e9:.0f}" for v in setup["sgemm"].values()) + " GFLOP/s"),
        ("load average at start", setup["load"]),
    ]
    summary = []
    for n, r in runs.items():
        more, part = run_rows(n, r, flops[n], rate, hf, args)
        rows += more
        summary.append(part)
    if hf is not None:
        rows.append(("transformers torch threads", str(hf.get("torch_threads"))))
    for name, sync, asy in asyncs:
        ratio = tokens_per_s(asy) / tokens_per_s(sync)
        rows.append((f"async / sync, {name}",
                     f"{tokens_per_s(asy):.1f} / {tokens_per_s(sync):.1f} tok/s = x{ratio:.2f}"
                     f" (same outputs: {asy['outputs'] == sync['outputs']})"))
        summary.append(f"async x{ratio:.2f} ({name.split(',')[0]})")
    if pool is not None:
        rows.append(("x8 / x1 pool time (same outputs)", f"{pool[0]:.2f} ({pool[1]})"))
        summary.append(f"pool ratio {pool[0]:.2f}")
    if steps:
        total = sum(t for times in steps.values() for t, _ in times)
        rows.append((f"step times, {max(runs)} requests, sync (bucket: steps, mean, total)",
                     f"{total:.1f} s"))
        for bucket, times in steps.items():
            spent = sum(t for t, _ in times)
            rows.append((f"  bucket {bucket}",
                         f"{len(times)} steps, {1e3 * spent / len(times):.1f} ms each, "
                         f"{spent:.2f} s ({100 * spent / total:.0f}%), "
                         f"{sum(n for _, n in times) / len(times):.1f} tokens scheduled"))
    rows.append(("peak RSS",
                 f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"))
    print_table(rows)
    print("SUMMARY: " + "; ".join(summary))
