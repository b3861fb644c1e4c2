"""The sparse MoE layer against every expert on every token (docs/BENCHMARKS.md §11).

    PYTHONPATH=. python benchmarks/moe.py [--tokens 1,4,16,64,512,2048] [--experts 8] [--top-k 2]
        [--hidden 512] [--width 1024] [--repeats 7] [--impl native|tiles|xla]
    PYTHONPATH=. python benchmarks/moe.py --model [--layers 4] [--repeats 7]

A random `SparseMoE` (float32, one device) is timed at decode-shaped (1 to 64 tokens) and
prefill-shaped (512, 2048 tokens) batches against the same weights run densely: every token
through all E experts, each output weighted by its routing weight (zero where unselected),
which is what a layer without a grouped matmul computes. Both give the same output (checked).
Then the grouped matmul alone on the prefill shapes' routed rows: GFLOP/s counting only the
real work (2 * rows * D * F), against ``jax.lax.ragged_dot`` at the same rows and a plain dot
[rows, D] @ [D, F] of the same FLOPs (the rate the grouped one aims for). Programs are compiled
first; the kinds run interleaved `--repeats` times and the fastest run of each is kept, since
the shared machine's load moves single runs by more than the effect. Ends with a one-line
summary of the sparse/dense ratios.

`--model`: whole engine steps of a random Mixtral-shaped model (the same sizes, `--layers`
layers, 8 heads of 64, KV heads 2) built as the engine builds it (`model_fns`: packed
projections, the native attention kernel on CPU) against the same model with every layer's
experts computed densely as above: decode steps (`--decode` requests of one token at context
256) and a prefill step (one 512-token chunk).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.engine.build import model_fns
from jaxengine.model.batch import RequestChunk, pack_batch
from jaxengine.model.config import ModelConfig
from jaxengine.model.decoder import Model
from jaxengine.model.mesh import make_mesh
from jaxengine.model.moe import SparseMoE
from jaxengine_kernels import default_grouped_impl, default_impl, grouped_matmul


def dense_weights(moe: SparseMoE) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The experts side by side, laid out once for plain dots: gate, up [D, E*F] and
    down [E*F, D] (the strongest dense layout; XLA's batched einsums over [E, D, F] ran
    several times slower on CPU)."""
    ex = moe.experts
    E, D, F = ex.gate_proj.shape
    side_by_side = lambda w: jnp.transpose(w, (1, 0, 2)).reshape(D, E * F)  # noqa: E731
    return (side_by_side(ex.gate_proj[...]), side_by_side(ex.up_proj[...]),
            ex.down_proj[...].reshape(E * F, D))


def dense_all_experts(moe: SparseMoE, weights: tuple[jax.Array, jax.Array, jax.Array],
                      x: jax.Array) -> jax.Array:
    """The layer computed without routing the work: x [T, D] through every expert, each
    expert's hidden units scaled by its routing weight (zero for the experts not chosen)."""
    gate, up, down = weights
    T, E = x.shape[0], moe.num_experts
    experts, routed = moe.route(x)  # [T, k]
    scale = jnp.zeros((T, E), x.dtype).at[jnp.arange(T)[:, None], experts].set(routed)
    hidden = (jax.nn.silu(x @ gate) * (x @ up)).reshape(T, E, -1) * scale[:, :, None]
    return hidden.reshape(T, -1) @ down  # [T, E*F] @ [E*F, D]


def best_times(fns: dict[str, Callable[[], jax.Array]], repeats: int) -> dict[str, float]:
    """Seconds of the fastest of `repeats` interleaved runs of each (compiled first)."""
    for fn in fns.values():
        fn().block_until_ready()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn().block_until_ready()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def layer_rows(moe: SparseMoE, tokens: list[int], repeats: int) -> list[float]:
    """Print sparse vs dense per token count; return the sparse/dense ratios."""
    graph, state = nnx.split(moe)
    sparse = jax.jit(lambda state, x: nnx.merge(graph, state)(x))
    weights = dense_weights(moe)
    dense = jax.jit(lambda state, x: dense_all_experts(nnx.merge(graph, state), weights, x))
    rng = np.random.default_rng(0)
    ratios = []
    print(f"{'tokens':>7} {'dense ms':>9} {'sparse ms':>10} {'sparse/dense':>13}")
    for T in tokens:
        x = jnp.asarray(rng.standard_normal((T, moe.experts.gate_proj.shape[1])), jnp.float32)
        np.testing.assert_allclose(np.asarray(sparse(state, x)), np.asarray(dense(state, x)),
                                   rtol=1e-3, atol=1e-5)
        t = best_times({"dense": lambda x=x: dense(state, x),
                        "sparse": lambda x=x: sparse(state, x)}, repeats)
        ratios.append(t["sparse"] / t["dense"])
        print(f"{T:>7} {t['dense'] * 1e3:>9.2f} {t['sparse'] * 1e3:>10.2f} {ratios[-1]:>13.2f}")
    return ratios


def matmul_rows(moe: SparseMoE, tokens: list[int], repeats: int, impl: str) -> None:
    """Print the grouped matmul's GFLOP/s (real work) against ragged_dot's and a plain dot's."""
    w = moe.experts.gate_proj[...]  # [E, D, F]
    E, D, F = w.shape
    grouped = jax.jit(lambda x, s: grouped_matmul(x, w, s, impl=impl))
    ragged = jax.jit(lambda x, s: grouped_matmul(x, w, s, impl="xla"))
    plain = jax.jit(lambda x: jnp.dot(x, w[0]))
    rng = np.random.default_rng(1)
    print(f"\n{'rows':>7} {'grouped GFLOP/s':>16} {'ragged_dot GFLOP/s':>19} "
          f"{'plain dot GFLOP/s':>18}   ({impl}; E={E}, D={D}, F={F})")
    for T in tokens:
        x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
        experts, _ = moe.route(x)
        sizes = jnp.asarray(np.bincount(np.asarray(experts).ravel(), minlength=E), jnp.int32)
        rows = jnp.asarray(rng.standard_normal((T * moe.top_k, D)), jnp.float32)
        t = best_times({"grouped": lambda r=rows, s=sizes: grouped(r, s),
                        "ragged": lambda r=rows, s=sizes: ragged(r, s),
                        "plain": lambda r=rows: plain(r)}, repeats)
        flops = 2 * rows.shape[0] * D * F
        print(f"{rows.shape[0]:>7} {flops / t['grouped'] / 1e9:>16.1f} "
              f"{flops / t['ragged'] / 1e9:>19.1f} {flops / t['plain'] / 1e9:>18.1f}")


class DenseAllExperts(nnx.Module):
    """A `SparseMoE`'s weights computed by `dense_all_experts` (the model's FFN swapped for it)."""

    def __init__(self, moe: SparseMoE) -> None:
        self.moe = moe
        self.dense = nnx.Variable(dense_weights(moe))

    def __call__(self, x: jax.Array, live: jax.Array | None = None) -> jax.Array:
        del live  # every row through every expert: the padding too
        return dense_all_experts(self.moe, self.dense.get_value(), x)


def model_rows(args: argparse.Namespace) -> list[float]:
    """Decode and prefill steps of the model, sparse and dense-all-experts; their ratios."""
    cfg = ModelConfig.tiny(
        "mixtral", vocab_size=1000, hidden_size=args.hidden, intermediate_size=args.width,
        num_layers=args.layers, num_heads=8, num_kv_heads=2, head_dim=args.hidden // 8,
        max_position_embeddings=4096, num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.width)
    sparse, dense = Model(cfg, seed=0), Model(cfg, seed=0)
    for block in dense.layers:
        block.moe = DenseAllExperts(block.moe)
    attn = default_impl()
    fns = {name: model_fns(m, cfg, attn_impl=attn) for name, m in
           (("sparse", sparse), ("dense", dense))}
    block_size, context = 16, 256
    pages = context // block_size
    def decode(n: int) -> list[RequestChunk]:
        return [RequestChunk(token_ids=[7 + r], start=context - 1,
                             block_table=list(range(1 + r * pages, 1 + (r + 1) * pages)))
                for r in range(n)]

    prefill = [RequestChunk(token_ids=list(range(1, 513)), start=0,
                            block_table=list(range(1, 1 + 512 // block_size)))]
    shapes = [(f"decode {n}x1 @{context}", decode(n), max(n, 8)) for n in args.decode]
    print(f"\nmodel: Mixtral-shaped, {cfg.num_layers} layers, D={cfg.hidden_size}, "
          f"E={cfg.num_experts} top-{cfg.num_experts_per_tok}, F={args.width}, attention "
          f"{attn!r}")
    ratios = []
    for name, chunks, tokens in [*shapes, ("prefill 1x512", prefill, 512)]:
        batch = pack_batch(chunks, num_tokens=tokens, max_seqs=16, max_blocks=pages * 2,
                           block_size=block_size)
        calls = {}
        for kind, f in fns.items():
            step = jax.jit(f.step)
            kv = f.init_kv(1 + 16 * pages, block_size)
            calls[kind] = (lambda step=step, f=f, kv=kv, batch=batch:
                           step(f.params, kv, batch)[1])
        got = {k: np.asarray(fn()) for k, fn in calls.items()}
        live = sum(len(c.token_ids) for c in chunks)
        np.testing.assert_allclose(got["sparse"][:live], got["dense"][:live], rtol=2e-3,
                                   atol=2e-3)
        best = best_times(calls, args.repeats)
        ratios.append(best["sparse"] / best["dense"])
        print(f"  {name:17} sparse {best['sparse'] * 1e3:8.2f} ms   dense-all-experts "
              f"{best['dense'] * 1e3:8.2f} ms   sparse/dense {ratios[-1]:.2f}x")
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,4,16,64,512,2048")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--impl", choices=("native", "tiles", "xla"),
                        default=default_grouped_impl())
    parser.add_argument("--model", action="store_true",
                        help="whole model steps instead of the layer")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--decode", default="1,4,16",
                        type=lambda s: [int(n) for n in s.split(",")],
                        help="decode batches (requests of one token) of --model")
    args = parser.parse_args()
    if args.model:
        *decode, prefill = model_rows(args)
        print("\nsummary: model step sparse/dense " + ", ".join(
            f"decode {n} {r:.2f}x" for n, r in zip(args.decode, decode, strict=True))
            + f", prefill 512 {prefill:.2f}x")
        return
    tokens = [int(t) for t in args.tokens.split(",")]
    moe = SparseMoE(args.hidden, args.width, args.experts, args.top_k, norm_topk_prob=True,
                    mesh=make_mesh(jax.devices()[:1]), dtype=jnp.float32, rngs=nnx.Rngs(0),
                    grouped_impl=args.impl)
    print(f"SparseMoE E={args.experts} top-{args.top_k} D={args.hidden} F={args.width} "
          f"float32, grouped matmul {args.impl!r} on {jax.default_backend()}")
    ratios = layer_rows(moe, tokens, args.repeats)
    matmul_rows(moe, [t for t in tokens if t >= 256] or tokens, args.repeats, args.impl)
    print("\nsummary: sparse/dense " + ", ".join(
        f"T={t} {r:.2f}x" for t, r in zip(tokens, ratios, strict=True)))


if __name__ == "__main__":
    main()
