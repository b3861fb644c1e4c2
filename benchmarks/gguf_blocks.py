"""GGUF blocks on the jnp path against float32 weights (docs/BENCHMARKS.md §2, "GGUF blocks").

    python benchmarks/gguf_blocks.py [--iters 20]

Times, in turn in one process, one `GGUFLinear` (blocks dequantized inside the jitted dot) and
the float32 product x @ W of the same values at SmolLM2-135M's matrices (q/o 576x576 and
gate/up 576x1536 in Q4_1, down 1536x576 in Q4_1, the tied LM head 49152x576 in Q8_0) for
T = 1, 8 and 64 rows: best-of wall ms over `--iters` calls each, and the ratio. Then the bytes
of the default model's weights on one device: its GGUF tensors as stored (what
quantization="gguf" holds) against float32.
"""

from __future__ import annotations

import argparse
import time

import gguf
import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.loading import default_model_path
from jaxengine.loading.gguf_file import open_gguf
from jaxengine.model.layers import COLUMN
from jaxengine.model.mesh import make_mesh
from jaxengine.model.quant.gguf import GGUFLinear

Q = gguf.GGMLQuantizationType
MATRICES = [("q_proj/o_proj", 576, 576, Q.Q4_1), ("gate/up_proj", 1536, 576, Q.Q4_1),
            ("down_proj", 576, 1536, Q.Q4_1), ("lm_head (tied)", 49152, 576, Q.Q8_0)]


def best_ms(fn: object, *args: object, iters: int) -> float:
    """Best-of wall milliseconds of `fn(*args)` after one warm-up call."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    iters = parser.parse_args().iters
    mesh, rng = make_mesh(jax.devices()[:1]), np.random.default_rng(0)
    blocks_dot = jax.jit(lambda lin, x: lin(x))
    float_dot = jax.jit(lambda w, x: x @ w)
    print(f"{'matrix':16} {'type':5} {'T':>3} {'blocks ms':>10} {'f32 ms':>8} {'ratio':>6}")
    for name, out, inp, qtype in MATRICES:
        rows = gguf.quants.quantize(rng.normal(0, 0.05, (out, inp)).astype(np.float32), qtype)
        lin = GGUFLinear(jnp.asarray(rows), qtype, sharding=COLUMN, mesh=mesh)
        w = jnp.asarray(gguf.quants.dequantize(rows, qtype).T)  # f32[in, out]
        for T in (1, 8, 64):
            x = jnp.asarray(rng.normal(0, 1, (T, inp)), jnp.float32)
            b, f = best_ms(blocks_dot, lin, x, iters=iters), best_ms(float_dot, w, x, iters=iters)
            print(f"{name:16} {qtype.name:5} {T:3d} {b:10.2f} {f:8.2f} {b / f:6.1f}")
    tensors = open_gguf(default_model_path()).tensors
    stored = sum(int(t.n_bytes) for t in tensors)
    f32 = sum(int(t.n_elements) * 4 for t in tensors)
    print(f"default model weights: {stored / 2**20:.1f} MiB as stored, {f32 / 2**20:.1f} MiB "
          f"float32: {stored / f32:.3f}x")


if __name__ == "__main__":
    main()
