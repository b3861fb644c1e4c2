"""One prepared check for a lent accelerator (NVIDIA H200, or a TPU): is the Pallas attention
kernel correct there, is it what the engine's compiled step runs, and how fast is it?

    python benchmarks/device_check.py [--quick] [--peak-gbps 4800] [--iters 20]
    python benchmarks/device_check.py --cpu-smoke    # CPU: interpret mode, tiny sizes

Sections, in order; each prints lines tagged with its name:
  correctness  the kernel against the jnp reference, both on the device, over a small grid of
               batches x head shapes x dtypes, with NaN / +Inf / -Inf garbage in every KV slot
               no query may attend to (``tests/jaxengine_kernels/cases.py``): max |kernel - ref|.
  engine-hlo   the engine's step (``model_fns`` with ``attention_backend(...)``, as
               ``build_engine`` makes them, jitted like the runner's) lowered and compiled: the
               Triton / Mosaic custom call must be in it and the jnp reference must not.
  timing       kernel vs reference, median ms (``benchmarks/attention.py``'s batches and timer);
  bandwidth    from the same runs: bytes of cached KV read / kernel time / ``--peak-gbps``.
  tensor-parallel  the engine's decode step (model step + greedy sampler, as the runner jits
               them) at tp = 1, 2, 4, 8 over the first tp devices, on a Llama-3-8B-shaped
               random bf16 model: median ms, and the bytes one device reads per step (its
               weight shards and its share of the KV cache) / step time / ``--peak-gbps``, the
               fraction of the HBM roofline. A tp larger than the device count is skipped.
  weights      the same decode step at tp=1 with bf16, int8 and fp8 weights (bf16 activations,
               ``quantization=``) and with bf16 weights over an fp8 KV cache
               (``kv_cache_dtype="fp8"``): median ms, weight and KV bytes, fraction of the HBM
               roofline, and how many greedy tokens equal bf16's.
  families     a Gemma-3-1B-shaped model (5 local : 1 global layers, window 512) and a
               Mixtral-shaped one (8 of its layers, 8 experts, top-2), random bf16: the
               kernel's custom call (and the experts' ragged_dot) in the compiled step, the
               decode step at context 8 x window: median ms and bytes read / time / peak.
  first-token  seconds from process start to the first generated token: a fresh subprocess
               imports jaxengine, builds ``LLM()`` over the default model (precompiled) and
               generates one token for a short prompt; cold (an empty compilation cache) then
               warm (the cache the cold run filled), with the imports / ``LLM()`` / generate
               split. A figure against the 5 s warm target, no threshold.
It ends with ``summary: PASS`` or ``summary: FAIL (...)`` and exits 1 on any failure; a section
that raises is a failure, and the later sections still run.

``--cpu-smoke`` runs every section on CPU: both kernels in interpret mode at tiny sizes, the
engine step lowered (not compiled) for an abstract H200 and TPU v6e, and tensor parallel on 4
virtual CPU devices (tp=8 skipped) with a tiny model, and the first token with the tiny
fixture model. Its timings mean nothing; it exists so that a test keeps this script from
rotting between device runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

SMOKE_DEVICES = 4  # virtual CPU devices of the smoke run, so that tp > 1 runs on CPU too
if "--cpu-smoke" in sys.argv and "device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +  # before jax is imported
                               f" --xla_force_host_platform_device_count={SMOKE_DEVICES}")

import jax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.device_sections.context import Context, report  # noqa: E402
from benchmarks.device_sections.first_token import first_token  # noqa: E402
from benchmarks.device_sections.kernel import correctness, engine_hlo, timing  # noqa: E402
from benchmarks.device_sections.model import families, quantized_weights, tensor_parallel  # noqa: E402
from jaxengine_kernels import default_impl  # noqa: E402

# Sections in report order: each takes the Context, prints its lines, returns its failures.
SECTIONS: list[Callable[[Context], list[str]]] = [correctness, engine_hlo, timing,
                                                  tensor_parallel, quantized_weights, families,
                                                  first_token]


def _context(args: argparse.Namespace) -> Context:
    backend = jax.default_backend()
    if args.cpu_smoke:
        return Context(impls=("tpu", "gpu"), interpret=True, smoke=True, quick=True,
                       peak_gbps=args.peak_gbps, iters=1)  # fmt: skip
    if backend == "cpu":
        raise SystemExit("device_check: no accelerator here; run with --cpu-smoke")
    iters = args.iters or (5 if args.quick else 20)
    return Context(impls=(default_impl(),), interpret=False, smoke=False, quick=args.quick,
                   peak_gbps=args.peak_gbps, iters=iters)  # fmt: skip


def main() -> int:
    """Run every section; print the summary line; 0 if all passed, else 1."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller grid, fewer iterations")
    p.add_argument("--cpu-smoke", action="store_true", help="CPU, interpret mode, tiny sizes")
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="HBM peak (H200: 4800)")
    p.add_argument("--iters", type=int, default=None, help="timed calls (default 20, quick 5)")
    ctx = _context(p.parse_args())
    print(f"device_check: backend={jax.default_backend()} ({jax.devices()[0].device_kind}) "
          f"jax={jax.__version__} impls={','.join(ctx.impls)} interpret={ctx.interpret} "
          f"{'smoke' if ctx.smoke else 'quick' if ctx.quick else 'full'}", flush=True)
    failures, t0 = [], time.perf_counter()
    for section in SECTIONS:
        try:
            failures += section(ctx)
        except Exception as e:  # report and go on: one device run should show every section
            traceback.print_exc()
            report(section.__name__, f"raised {type(e).__name__}: {e}", False)
            failures.append(f"{section.__name__} raised")
    verdict = "PASS" if not failures else f"FAIL ({'; '.join(failures)})"
    print(f"summary: {verdict} in {time.perf_counter() - t0:.0f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
