"""The CPU's FLOP roofline for `benchmarks/throughput.py` (docs/BENCHMARKS.md §2): the machine's
sgemm rate, and the FLOPs a workload needs; a run's roofline share is useful FLOPs / (elapsed x
rate)."""

from __future__ import annotations

import time
from typing import Any


def sgemm_rate(n: int = 2048, repeat: int = 5) -> dict[str, float]:
    """FLOP/s of a float32 n x n matmul, best of `repeat`, in jax (jitted) and numpy."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    rates = {}
    mm = jax.jit(lambda x, y: x @ y)
    x = jnp.asarray(a)
    for name, run in (("jax", lambda: mm(x, x).block_until_ready()), ("numpy", lambda: a @ a)):
        run()
        best = min(_seconds(run) for _ in range(repeat))
        rates[name] = 2 * n**3 / best
    return rates


def _seconds(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def useful_flops(cfg: Any, requests: list[dict[str, Any]]) -> dict[str, float]:
    """FLOPs the workload needs, padding excluded: matmuls, LM head and attention.

    A request of P prompt tokens and M outputs runs P + M - 1 tokens through the layers (the
    last output is sampled, never fed back) and M rows through the LM head. Per token and
    layer the projections and MLP cost 2 x their weights; attention at position p (0-based)
    costs 4·N·H·(p + 1) (QK^T and PV over the p + 1 visible keys).
    """
    D, F, N, K, H = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                     cfg.head_dim)
    weights = D * (N + 2 * K) * H + N * H * D + 3 * D * F  # one layer's matrices
    tokens = outputs = positions = 0
    for r in requests:
        n = len(r["prompt_token_ids"]) + r["max_tokens"] - 1
        tokens, outputs = tokens + n, outputs + r["max_tokens"]
        positions += n * (n + 1) // 2  # sum of (p + 1) over p < n
    matmul = 2.0 * weights * cfg.num_layers * tokens
    head = 2.0 * D * cfg.vocab_size * outputs
    attention = 4.0 * N * H * cfg.num_layers * positions
    return dict(matmul=matmul, head=head, attention=attention,
                total=matmul + head + attention)
