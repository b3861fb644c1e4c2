"""The CPU matmuls over quantized weights against the float32 packed one (docs/BENCHMARKS.md §2,
"Quantized projections").

    PYTHONPATH=. python benchmarks/quantized_matmul.py [--rows 1,4,16,64] [--rounds 5]
        [--repeats 5] [--shapes qkv,o,gate_up,down,head]

SmolLM2-135M's projections with random weights, each as many layers as the model has (30; the
tied LM head once), so that every call reads its weights from memory as a decode step does:
the float32 packed matmul (`packed_matmul`, the fused `packed_swiglu` for gate/up), int8 panels
(`packed_matmul_int8` / `packed_swiglu_int8`) and GGUF Q4_1 and Q8_0 blocks (`block_matmul` /
`block_swiglu`). Each kind's program is compiled first; the kinds run interleaved, `--rounds`
rounds of the best of `--repeats` calls, and the median of the rounds is printed (ms for all
layers) with its ratio to float32 at the same row count. The first line names the kernels'
path and the CPU: figures of different paths or CPUs do not compare.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType, quants

from benchmarks.throughput import cpu_kernels
from jaxengine.model.quant import INT8, quantize
from jaxengine_kernels.cpu import block_matmul as bm
from jaxengine_kernels.cpu import matmul as pm

# name: (K, N, layers, SwiGLU pair)
SHAPES = {
    "qkv": (576, 960, 30, False),
    "o": (576, 576, 30, False),
    "gate_up": (576, 1536, 30, True),
    "down": (1536, 576, 30, False),
    "head": (576, 49152, 1, False),
}
KINDS = ("float32", "int8", "Q4_1", "Q8_0")


def int8_of(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w f32[K, N] -> values i8[K, N], scales f32[K/32, N] (`quantization="int8"`'s)."""
    return quantize(w, INT8, axis=-2)


def layer_calls(K: int, N: int, glu: bool, rng: np.random.Generator
                ) -> dict[str, Callable[[jax.Array], jax.Array]]:
    """One layer's product of each kind, x f32[T, K] -> f32[T, N], over random weights."""
    parts = [rng.standard_normal((K, N), np.float32) * 0.05 for _ in range(2 if glu else 1)]
    blocks = {}
    for name in ("Q4_1", "Q8_0"):
        kind = GGMLQuantizationType[name]
        blocks[name] = [jnp.asarray(quants.quantize(w.T.copy(), kind)) for w in parts]
    ints = [int8_of(w) for w in parts]
    if glu:
        panels = pm.pack_swiglu(*parts)
        panels8, scale = pm.pack_swiglu_int8(*ints[0], *ints[1])
        return {
            "float32": lambda x: pm.packed_swiglu(x, panels, N),
            "int8": lambda x: pm.packed_swiglu_int8(x, panels8, scale, N),
            **{name: (lambda x, b=b, name=name: bm.block_swiglu(x, b[0], b[1], name))
               for name, b in blocks.items()},
        }
    panels, (panels8, scale) = pm.pack(parts[0]), pm.pack_int8(*ints[0])
    return {
        "float32": lambda x: pm.packed_matmul(x, panels, N),
        "int8": lambda x: pm.packed_matmul_int8(x, panels8, scale, N),
        **{name: (lambda x, b=b, name=name: bm.block_matmul(x, b[0], name))
           for name, b in blocks.items()},
    }


def best_of(fn: Callable[[jax.Array], list[jax.Array]], x: jax.Array, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"CPU kernels: {cpu_kernels()}")
    print("median ms over all layers (ratio to float32)")
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        K, N, layers, glu = SHAPES[shape]
        calls = [layer_calls(K, N, glu, rng) for _ in range(layers)]
        fns = {kind: jax.jit(lambda x, kind=kind, calls=calls: [c[kind](x) for c in calls])
               for kind in KINDS}
        for T in rows:
            x = jnp.asarray(rng.standard_normal((T, K), np.float32))
            for fn in fns.values():
                jax.block_until_ready(fn(x))  # compiled before any timing
            times: dict[str, list[float]] = {kind: [] for kind in KINDS}
            for _ in range(args.rounds):
                for kind, fn in fns.items():
                    times[kind].append(best_of(fn, x, args.repeats))
            med = {kind: statistics.median(t) * 1e3 for kind, t in times.items()}
            cells = "  ".join(f"{kind} {med[kind]:7.2f} ({med['float32'] / med[kind]:.2f}x)"
                              for kind in KINDS)
            print(f"{shape:8s} K={K:5d} N={N:6d} x{layers:2d} T={T:3d}: {cells}", flush=True)


if __name__ == "__main__":
    main()
