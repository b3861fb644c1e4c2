"""Ragged paged attention alone (docs/BENCHMARKS.md §4).

Fixed shapes: 64 requests with contexts U[1k, 8k], Llama-3-8B head geometry (32 q heads, 8 kv
heads, head_dim 128), page size 16, bfloat16, two batches:
  decode   64 decodes
  mixed    56 decodes + 8 prefill chunks of 256 tokens

    python benchmarks/attention.py [--mode auto|check|time|cpu] [--impls reference,gpu]
                                   [--peak-gbps 4300] [--iters 20] [--small]
                                   [--blocks pages_per_iter=8,num_splits=4] [--baseline REV]
                                   [--sliding-window W] [--cache-dtypes float32,float8_e4m3fn]

``check`` (the default on CPU) runs the Pallas kernels in interpret mode against the jnp
reference at a reduced size and prints their errors. ``time`` (the default on GPU / TPU) times
each implementation with the cache donated and reports achieved HBM bandwidth — unique bytes
of KV read + new K/V written + Q + O, divided by the median time — as a fraction of
``--peak-gbps`` (H200: ~4.3 TB/s measured copy bandwidth), and the speedup over the reference.
Prints a table and a one-line summary. ``--small`` shrinks the batches (to try ``time`` on CPU).
``cpu`` times the jnp reference and the native CPU kernel (``--impls``) on CPU at SmolLM2's
heads in float32 (prefills, a chunk after a cached prefix, decodes), in turn in one process
with the cache donated: best-of wall and CPU ms per layer, wall GFLOP/s against the sgemm rate,
and each one's speedup over the reference; with ``--baseline REV`` also the reference as of git
revision REV; with ``--cache-dtypes`` each implementation once per cache dtype (the float32
cache's values cast to it: what a quantized cache costs to read, scales 1), stored as the
engine stores it on CPU (fp8 as its bits in uint8, ``cache_dtype.storage_dtype``).

``--sliding-window W`` (``cpu`` and ``time`` modes) measures instead what a window saves: 16
decodes at SmolLM2's heads in float32 at context W and at 8·W, each implementation once with
the window W and once with full attention (one compiled function, the window an operand as in
the model), all in turn, best-of wall ms per layer; the pages lie in one pool sized for 8·W and
every call reads them from memory (a 1 GiB host buffer is rewritten before it; on an
accelerator a context of W may still sit in its L2). A windowed layer skips the pages outside
its window, so its time stays flat from W to 8·W while the full layer's grows about 8x.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxengine_kernels import default_impl, ragged_paged_attention  # noqa: E402
from jaxengine_kernels.cache_dtype import storage_dtype  # noqa: E402


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """One batch to measure."""

    name: str
    num_decodes: int
    num_prefills: int
    chunk: int  # tokens per prefill chunk
    context: tuple[int, int]  # context length range after the step
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16


FULL = [
    Shape(name="decode", num_decodes=64, num_prefills=0, chunk=256, context=(1024, 8192)),
    Shape(name="mixed", num_decodes=56, num_prefills=8, chunk=256, context=(1024, 8192)),
]
SMALL = [  # interpret mode is slow: a few requests, short contexts
    Shape(name="decode", num_decodes=6, num_prefills=0, chunk=32, context=(64, 512)),
    Shape(name="mixed", num_decodes=4, num_prefills=2, chunk=32, context=(64, 512)),
]


def make_batch(shape: Shape, dtype: jnp.dtype, seed: int = 0) -> dict[str, jax.Array]:
    """Random inputs for ``shape`` with shuffled block tables (cache generated on device)."""
    rng = np.random.default_rng(seed)
    R = shape.num_decodes + shape.num_prefills
    L, K, N, H = shape.page_size, shape.num_kv_heads, shape.num_heads, shape.head_dim
    seq_lens = rng.integers(*shape.context, size=R, endpoint=True).astype(np.int32)
    q_lens = np.array([shape.chunk] * shape.num_prefills + [1] * shape.num_decodes, np.int32)
    n_pages = -(-seq_lens // L)
    max_blocks = int(n_pages.max())
    perm = 1 + rng.permutation(int(n_pages.sum())).astype(np.int32)  # page 0: null block
    block_tables = np.zeros((R, max_blocks), np.int32)
    offsets = np.concatenate([[0], np.cumsum(n_pages)])
    for r in range(R):
        block_tables[r, : n_pages[r]] = perm[offsets[r] : offsets[r + 1]]
    T_live = int(q_lens.sum())
    T = -(-T_live // 16) * 16  # token buckets are multiples of 16
    qsl = np.zeros(R + 1, np.int32)
    qsl[1:] = np.cumsum(q_lens)
    slots = np.zeros(T, np.int32)
    for r in range(R):
        pos = np.arange(seq_lens[r] - q_lens[r], seq_lens[r])
        slots[qsl[r] : qsl[r + 1]] = block_tables[r, pos // L] * L + pos % L
    keys = jax.random.split(jax.random.key(seed), 4)
    P = 1 + int(n_pages.sum())
    return {
        "q": jax.random.normal(keys[0], (T, N, H), dtype),
        "k": jax.random.normal(keys[1], (T, K, H), dtype),
        "v": jax.random.normal(keys[2], (T, K, H), dtype),
        "kv_cache": jax.random.normal(keys[3], (P, L, 2 * K, H), dtype),
        "slot_mapping": jnp.asarray(slots),
        "block_tables": jnp.asarray(block_tables),
        "seq_lens": jnp.asarray(seq_lens),
        "query_start_loc": jnp.asarray(qsl),
        "num_seqs": jnp.asarray(R, jnp.int32),
    }


def kv_read_bytes(batch: dict[str, jax.Array]) -> int:
    """Bytes of cached K/V the step must read: every live context once."""
    _, _, K2, H = batch["kv_cache"].shape
    return int(batch["seq_lens"].sum()) * K2 * H * batch["kv_cache"].dtype.itemsize


def bytes_moved(batch: dict[str, jax.Array]) -> int:
    """Unique HBM bytes: every live context once, new K/V in and out, Q in, O out."""
    T, N, H = batch["q"].shape
    K2 = batch["kv_cache"].shape[2]
    item = batch["q"].dtype.itemsize
    kv_new = 2 * T * K2 * H  # read as k, v; written into the cache
    return kv_read_bytes(batch) + (kv_new + 2 * T * N * H) * item


def attention_fn(impl: str, interpret: bool, blocks: dict[str, int] | None = None) -> Callable:
    """``impl`` jitted over the batch dict with the cache donated (updated in place)."""
    scale = 128**-0.5
    blocks = blocks if impl != "reference" else None

    @functools.partial(jax.jit, donate_argnames=("kv_cache",))
    def run(kv_cache: jax.Array, rest: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        args = dict(rest, kv_cache=kv_cache)
        return ragged_paged_attention(
            **args, sm_scale=scale, impl=impl, interpret=interpret, **(blocks or {})
        )

    return run


def time_impl(
    impl: str, batch: dict, iters: int, interpret: bool, blocks: dict[str, int] | None = None
) -> tuple[float, jax.Array]:
    """Median seconds per call (after one warm-up call) and the first output."""
    fn = attention_fn(impl, interpret, blocks)
    rest = {n: a for n, a in batch.items() if n != "kv_cache"}
    cache = jnp.copy(batch["kv_cache"])
    out, cache = fn(cache, rest)  # compile + warm-up; rewriting the same slots is idempotent
    first = out.block_until_ready()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out, cache = fn(cache, rest)
        out.block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), first


def live_error(out: jax.Array, ref: jax.Array, batch: dict) -> float:
    """Max |out - ref| over the live tokens."""
    T = int(batch["query_start_loc"][int(batch["num_seqs"])])
    diff = out[:T].astype(jnp.float32) - ref[:T].astype(jnp.float32)
    return float(jnp.abs(diff).max())


def run_time(shapes: list[Shape], impls: list[str], args: argparse.Namespace) -> list[str]:
    """Time every impl on every shape; print the table rows; return summary fragments."""
    interpret = jax.default_backend() == "cpu"
    print(f"{'batch':8} {'impl':10} {'tokens':>6} {'ms':>9} {'GB/s':>8} {'% peak':>7} "
          f"{'speedup':>8} {'max err':>9}")  # fmt: skip
    summary = []
    for shape in shapes:
        batch = make_batch(shape, jnp.dtype(args.dtype), args.seed)
        moved = bytes_moved(batch)
        ref_t, ref_out = time_impl("reference", batch, args.iters, interpret)
        for impl in impls:
            t, out = (ref_t, ref_out) if impl == "reference" else time_impl(
                impl, batch, args.iters, interpret, args.blocks)  # fmt: skip
            gbps = moved / t / 1e9
            err = live_error(out, ref_out, batch)
            print(f"{shape.name:8} {impl:10} {batch['q'].shape[0]:6d} {t * 1e3:9.3f} "
                  f"{gbps:8.1f} {100 * gbps / args.peak_gbps:6.1f}% {ref_t / t:7.2f}x "
                  f"{err:9.2e}")  # fmt: skip
            if impl != "reference":
                summary.append(f"{shape.name}: {impl} {100 * gbps / args.peak_gbps:.0f}% of peak, "
                               f"{ref_t / t:.1f}x reference")  # fmt: skip
    return summary


def run_check(shapes: list[Shape], impls: list[str], args: argparse.Namespace) -> list[str]:
    """Kernels in interpret mode against the reference; print errors; return summary fragments."""
    print(f"{'batch':8} {'impl':10} {'dtype':9} {'tokens':>6} {'max err':>9} {'s (interp.)':>11}")
    tol = {"float32": 1e-4, "bfloat16": 5e-2}
    summary, worst = [], True
    for dtype in ("float32", "bfloat16"):
        for shape in shapes:
            batch = make_batch(shape, jnp.dtype(dtype), args.seed)
            rest = {n: a for n, a in batch.items() if n != "kv_cache"}
            ref_out, _ = attention_fn("reference", False)(jnp.copy(batch["kv_cache"]), rest)
            for impl in impls:
                t0 = time.perf_counter()
                fn = attention_fn(impl, True, args.blocks)
                out, _ = fn(jnp.copy(batch["kv_cache"]), rest)
                out.block_until_ready()
                err = live_error(out, ref_out, batch)
                worst &= err <= tol[dtype]
                print(f"{shape.name:8} {impl:10} {dtype:9} {batch['q'].shape[0]:6d} {err:9.2e} "
                      f"{time.perf_counter() - t0:11.1f}")  # fmt: skip
    summary.append(f"{', '.join(impls)} (interpret) vs reference: "
                   f"{'PASS' if worst else 'FAIL'} (tol f32 1e-4, bf16 5e-2)")  # fmt: skip
    return summary


# --mode cpu: the reference alone on CPU at SmolLM2's heads (9 q, 3 kv, head_dim 64), float32,
# 16-token pages; (name, [(scheduled tokens, context after the step)] per request).
_RNG = np.random.default_rng(1)  # the mixed decode contexts
CPU_CASES = [
    ("prefill 512", [(512, 512)]),
    ("prefills 1280+256", [(1280, 1280), (256, 256)]),
    ("chunk 768 after 512", [(768, 1280)]),
    ("32 decodes@1000 + 256", [(256, 256)] + [(1, 1000)] * 32),
    ("64 decodes@300", [(1, 300)] * 64),
    ("8 decodes@300", [(1, 300)] * 8),
    ("64 decodes@U[40,1500]", [(1, int(c)) for c in _RNG.integers(40, 1500, 64)]),
    ("1 decode@1500 + 15@40", [(1, 1500)] + [(1, 40)] * 15),
    ("64 decodes@4000", [(1, 4000)] * 64),  # 377 MiB of float32 KV: a long context
]


def cpu_batch(reqs: list[tuple[int, int]], seed: int = 0,
              pool_pages: int = 0) -> tuple[dict, float]:
    """A float32 batch for ``reqs`` (pages shuffled over a pool of at least ``pool_pages``)
    and its useful attention FLOPs."""
    rng = np.random.default_rng(seed)
    N, K, H, L = 9, 3, 64, 16
    n_pages = [-(-c // L) for _, c in reqs]
    perm = 1 + rng.permutation(max(sum(n_pages), pool_pages))[: sum(n_pages)].astype(np.int32)
    tables = np.zeros((len(reqs), max(n_pages)), np.int32)
    starts = np.cumsum([0] + n_pages)
    for r in range(len(reqs)):
        tables[r, : n_pages[r]] = perm[starts[r] : starts[r + 1]]
    qsl = np.cumsum([0] + [q for q, _ in reqs]).astype(np.int32)
    T = -(-int(qsl[-1]) // 16) * 16
    slots = np.zeros(T, np.int32)
    for r, (q, c) in enumerate(reqs):
        pos = np.arange(c - q, c)
        slots[qsl[r] : qsl[r + 1]] = tables[r, pos // L] * L + pos % L
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32))  # noqa: E731
    batch = dict(q=f32(T, N, H), k=f32(T, K, H), v=f32(T, K, H),
                 kv_cache=f32(int(perm.max()) + 1, L, 2 * K, H), slot_mapping=jnp.asarray(slots),
                 block_tables=jnp.asarray(tables),
                 seq_lens=jnp.asarray(np.array([c for _, c in reqs], np.int32)),
                 query_start_loc=jnp.asarray(qsl), num_seqs=jnp.asarray(np.int32(len(reqs))))
    # QK^T and PV: 4·N·H per (query, visible key) pair; query i of q sees c - q + i + 1 keys.
    flops = sum(4 * N * H * (q * (c - q) + q * (q + 1) / 2) for q, c in reqs)
    return batch, flops


def reference_at(rev: str) -> Callable:
    """``ragged_paged_attention_reference`` as of git revision ``rev`` (for ``--baseline``)."""
    src = subprocess.run(["git", "show", f"{rev}:jaxengine_kernels/reference.py"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    module = types.ModuleType(f"reference_at_{rev}")
    exec(compile(src, f"{rev}:jaxengine_kernels/reference.py", "exec"), module.__dict__)
    return module.ragged_paged_attention_reference


def run_cpu(shapes: list[Shape], impls: list[str], args: argparse.Namespace) -> list[str]:
    """The CPU implementations at ``CPU_CASES`` (``shapes`` does not apply), timed in turn in
    one process with the cache donated: best-of wall and CPU ms per layer, the wall GFLOP/s and
    share of the sgemm rate, and each one's wall-time speedup over the first impl (the
    reference); with ``--baseline`` the reference as of REV too."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32))
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    rate = 2 * 2048**3 / min(_wall_seconds(lambda: mm(a).block_until_ready()) for _ in range(5))
    print(f"sgemm (2048^2 f32, jax, wall): {rate / 1e9:.0f} GFLOP/s")
    dtypes = [jnp.dtype(d) for d in args.cache_dtypes.split(",")]

    def fn(impl: str, dtype: jnp.dtype) -> tuple[Callable, jnp.dtype, jnp.dtype]:
        stored = storage_dtype(dtype, impl=impl, platform="cpu")
        return jax.jit(functools.partial(
            ragged_paged_attention, sm_scale=64**-0.5, impl=impl,
            kv_cache_dtype=dtype if stored != dtype else None,
            **(args.blocks if impl != "reference" and args.blocks else {})),
            donate_argnames="kv_cache"), dtype, stored  # fmt: skip

    # name -> (function, cache dtype, its storage): each impl once per cache dtype.
    fns = {(i if len(dtypes) == 1 else f"{i} {d.name}"): fn(i, d) for i in impls for d in dtypes}
    if args.baseline:
        fns[f"ref@{args.baseline}"] = (jax.jit(functools.partial(
            reference_at(args.baseline), sm_scale=64**-0.5), donate_argnames="kv_cache"),
            dtypes[0], dtypes[0])  # fmt: skip
    names = list(fns)
    print(f"{'batch':24} {'GFLOP':>6} " + " ".join(
        f"{n + ' wall/cpu ms':>24} {'GF/s':>6} {'sgemm':>6} {'x':>5}" for n in names))
    summary = []
    for name, reqs in CPU_CASES:
        batch, flops = cpu_batch(reqs, args.seed)
        caches = {}
        for n, (f, dtype, stored) in fns.items():  # compile, and a cache of its own to donate
            cache = jax.lax.bitcast_convert_type(jnp.array(batch["kv_cache"], dtype), stored)
            out, caches[n] = f(**dict(batch, kv_cache=cache))
            out.block_until_ready()
        wall = dict.fromkeys(names, float("inf"))
        cpu = dict.fromkeys(names, float("inf"))
        for _ in range(args.iters):  # in turn, so that all see the same neighbours
            for n, (f, _, _) in fns.items():
                t0, c0 = time.perf_counter(), time.process_time()
                out, caches[n] = f(**dict(batch, kv_cache=caches[n]))
                out.block_until_ready()
                wall[n] = min(wall[n], time.perf_counter() - t0)
                cpu[n] = min(cpu[n], time.process_time() - c0)
        line = f"{name:24} {flops / 1e9:6.3f} "
        for n in names:
            line += (f"{1e3 * wall[n]:11.2f} /{1e3 * cpu[n]:9.2f} {flops / wall[n] / 1e9:6.1f} "
                     f"{100 * flops / wall[n] / rate:5.1f}% {wall[names[0]] / wall[n]:4.1f}x ")
        print(line)
        summary.append(f"{name} " + ", ".join(f"{n} {1e3 * wall[n]:.2f} ms" for n in names))
    return summary


def run_window(impls: list[str], args: argparse.Namespace) -> list[str]:
    """Decode attention at context W and 8·W, with the window W and without, all timed in turn
    (best of ``--iters``); print the table, return each implementation's 8·W / W time ratios
    (windowed, full)."""
    W = args.sliding_window
    fns = {i: jax.jit(functools.partial(ragged_paged_attention, sm_scale=64**-0.5, impl=i,
                                        **(args.blocks if i != "reference" and args.blocks
                                           else {})), donate_argnames="kv_cache")
           for i in impls}  # fmt: skip
    windows = {"window": jnp.int32(W), "full": jnp.int32(0)}
    # One pool for both contexts (an engine's is fixed): the pages of a context of W lie as far
    # apart as those of 8·W.
    batches = {ctx: cpu_batch([(1, ctx)] * 16, args.seed, pool_pages=16 * -(-8 * W // 16))[0]
               for ctx in (W, 8 * W)}  # fmt: skip
    runs = [(ctx, i, w) for ctx in batches for i in impls for w in windows]
    caches = {}
    for ctx, i, w in runs:  # compile, and a cache of its own to donate
        batch = batches[ctx]
        out, caches[ctx, i, w] = fns[i](**dict(batch, kv_cache=jnp.copy(batch["kv_cache"])),
                                        sliding_window=windows[w])  # fmt: skip
        out.block_until_ready()
    # Rewritten before each timed call, so that every call reads its KV from memory, as a
    # model's step does (its weights and other layers evict the pages), not from a cache that
    # holds a context of W (this Xeon's L3 holds 480 MiB).
    flush = np.zeros(1 << 28, np.float32)
    ms = dict.fromkeys(runs, float("inf"))
    for _ in range(args.iters):  # in turn, so that all see the same neighbours
        for run in runs:
            ctx, i, w = run
            flush += 1.0
            t0 = time.perf_counter()
            out, caches[run] = fns[i](**dict(batches[ctx], kv_cache=caches[run]),
                                      sliding_window=windows[w])  # fmt: skip
            out.block_until_ready()
            ms[run] = min(ms[run], 1e3 * (time.perf_counter() - t0))
    cols = [(i, w) for i in impls for w in windows]
    print(f"{'16 decodes at':>14} " + " ".join(f"{f'{i} {w} ms':>18}" for i, w in cols))
    for ctx in batches:
        print(f"{ctx:14d} " + " ".join(f"{ms[ctx, i, w]:18.3f}" for i, w in cols))
    ratios = {(i, w): ms[8 * W, i, w] / ms[W, i, w] for i, w in cols}
    print(f"{'8W / W':>14} " + " ".join(f"{ratios[col]:17.2f}x" for col in cols))
    return [f"{i}: W={W} decode 8W/W {ratios[i, 'window']:.2f}x windowed, "
            f"{ratios[i, 'full']:.2f}x full" for i in impls]


def _wall_seconds(fn: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _parse_blocks(text: str) -> dict[str, int]:
    """``"a=1,b=2"`` -> ``{"a": 1, "b": 2}``."""
    pairs = (item.split("=") for item in text.split(",") if item)
    return {name.strip(): int(value) for name, value in pairs}


def main() -> None:
    """Parse flags, run the check or the timing, print the summary line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("auto", "check", "time", "cpu"), default="auto",
                   help="cpu: the reference and the CPU kernel at SmolLM2's heads, float32")
    p.add_argument("--impls", default=None, help="comma-separated (default: by backend)")
    p.add_argument("--peak-gbps", type=float, default=4300.0, help="HBM peak (H200: ~4300)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small", action="store_true", help="reduced batches (for CPU)")
    p.add_argument(
        "--blocks", type=_parse_blocks, default=None,
        help="kernel block sizes, e.g. pages_per_iter=8,num_splits=4 (gpu) or block_q=32 (tpu)",
    )  # fmt: skip
    p.add_argument("--baseline", default=None, metavar="REV",
                   help="cpu mode: also time jaxengine_kernels/reference.py as of git REV")
    p.add_argument("--cache-dtypes", default="float32",
                   help="cpu mode: comma-separated KV cache dtypes, each impl once per dtype")
    p.add_argument("--sliding-window", type=int, default=0, metavar="W",
                   help="cpu/time modes: decodes at context W and 8W, windowed and full")
    args = p.parse_args()
    if args.sliding_window < 0:
        p.error(f"--sliding-window must be >= 0, got {args.sliding_window}")
    backend = jax.default_backend()
    mode = args.mode if args.mode != "auto" else ("check" if backend == "cpu" else "time")
    if args.impls:
        impls = args.impls.split(",")
    elif mode == "check":
        impls = ["tpu", "gpu"]
    elif mode == "cpu":
        impls = ["reference", "cpu"]
    else:
        impls = ["reference", default_impl()] if default_impl() != "reference" else ["reference"]
    shapes = SMALL if (args.small or mode == "check") else FULL
    print(f"backend={backend} ({jax.devices()[0].device_kind}) mode={mode} jax={jax.__version__}"
          f" impls={','.join(impls)} blocks={args.blocks or 'default'}")  # fmt: skip
    if args.sliding_window:
        if mode == "check":
            p.error("--sliding-window times the implementations: use --mode cpu or time")
        summary = run_window(impls, args)
    else:
        run = {"check": run_check, "time": run_time, "cpu": run_cpu}[mode]
        summary = run(shapes, impls, args)
    print("summary: " + ("; ".join(summary) or "reference only (no kernel for this backend)"))


if __name__ == "__main__":
    main()
