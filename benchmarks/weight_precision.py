"""Quantized weights against float32 on one model (docs/BENCHMARKS.md §13): accuracy
teacher-forced over fixed texts, the weights' bytes on the device, and one decode step's time.

    python benchmarks/weight_precision.py [--model PATH] [--quantization int8,fp8]
        [--decode-rows 64] [--repeats 20]

Accuracy: each text (the golden chat prompt with its greedy answer, and two paragraphs) is run
as one prefill; at every position the quantized model's top-1 token is compared with float32's
(agreement) and the log-probability each gives the text's next token (mean and max |delta|, in
nat). Memory: the bytes of `jax.live_arrays()` after loading, each model loaded alone. Speed:
one decode step of `--decode-rows` requests over the model's functions as the engine builds
them (`model_fns`: the packed CPU matmul where it applies), median of `--repeats`, the models
side by side in one run. Figures of different CPUs do not compare.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "fixtures" / "default" / "greedy.json"
PARAGRAPHS = [
    "The river rises in the hills north of the town and runs south through farmland for most "
    "of its length. In spring the meltwater floods the lower fields, which is why the old "
    "villages stand on the ridges and the newer houses, built after the embankments went up, "
    "sit close to the water. Fishing was the main trade until the mill opened in 1850.",
    "To make the sauce, melt the butter over a low heat, stir in the flour and cook it for a "
    "minute without letting it brown. Add the warm milk a little at a time, whisking after "
    "each addition so that no lumps form, then season with salt, pepper and a pinch of "
    "nutmeg. Simmer for five minutes until it coats the back of a spoon.",
]


def texts(tokenizer: Any) -> list[list[int]]:
    """Token ids of each text: the golden prompt + its greedy output, then the paragraphs."""
    golden = json.loads(GOLDEN.read_text())
    return [golden["prompt_ids"] + golden["greedy_ids"],
            *[tokenizer.encode(p) for p in PARAGRAPHS]]


def live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


def prefill_logits(fns: Any, cfg: Any, ids: list[int]) -> np.ndarray:
    """f32[len(ids), V] logits of one prefill of `ids` (a fresh cache)."""
    from jaxengine.model.batch import RequestChunk, pack_batch

    block = 16
    pages = -(-len(ids) // block)
    kv = fns.init_kv(pages + 1, block)
    batch = pack_batch([RequestChunk(token_ids=ids, start=0, block_table=list(range(1,
                                                                               pages + 1)))],
                       num_tokens=len(ids), max_seqs=1, max_blocks=pages, block_size=block)
    _, hidden = jax.jit(fns.step)(fns.params, kv, batch)
    return np.asarray(jax.jit(fns.compute_logits)(fns.params, hidden))[:len(ids), :cfg.vocab_size]


def decode_step_seconds(fns: Any, rows: int, repeats: int) -> float:
    """Median seconds of one decode step of `rows` requests, 64 tokens of context each."""
    from jaxengine.model.batch import RequestChunk, pack_batch

    block, context = 16, 64
    pages = context // block
    kv = fns.init_kv(rows * pages + 1, block)
    chunks = [RequestChunk(token_ids=[7], start=context - 1,
                           block_table=list(range(1 + r * pages, 1 + (r + 1) * pages)))
              for r in range(rows)]
    batch = pack_batch(chunks, num_tokens=rows, max_seqs=rows, max_blocks=pages,
                       block_size=block)
    step = jax.jit(fns.step, donate_argnames=("kv",))
    times = []
    for _ in range(repeats + 1):  # the first call compiles
        t0 = time.perf_counter()
        kv, hidden = step(fns.params, kv, batch)
        hidden.block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def measure(model_path: str | None, quantization: str | None, rows: int, repeats: int,
            token_ids: list[list[int]] | None) -> dict[str, Any]:
    """Load one model alone; its bytes on the device, its logits over the texts, its step."""
    from jaxengine.engine.build import model_fns
    from jaxengine.loading.load import load_model

    before = live_bytes()
    model, cfg, tokenizer = load_model(model_path, quantization=quantization)
    weights = live_bytes() - before
    fns = model_fns(model, cfg, attn_impl="cpu" if jax.default_backend() == "cpu" else "tpu")
    ids = token_ids or texts(tokenizer)
    out = {"bytes": weights, "ids": ids,
           "logits": [prefill_logits(fns, cfg, t) for t in ids],
           "step": decode_step_seconds(fns, rows, repeats)}
    del model, fns
    gc.collect()
    return out


def compare(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, float]:
    """Top-1 agreement and |delta logprob| of the next token over every text's positions."""
    agree, deltas = [], []
    for ids, a, b in zip(ref["ids"], ref["logits"], got["logits"], strict=True):
        la, lb = (np.asarray(jax.nn.log_softmax(x, axis=-1)) for x in (a, b))
        agree.extend(a.argmax(-1) == b.argmax(-1))
        nxt = np.asarray(ids[1:])
        deltas.extend(np.abs(la[np.arange(len(nxt)), nxt] - lb[np.arange(len(nxt)), nxt]))
    return {"agreement": float(np.mean(agree)), "mean_delta": float(np.mean(deltas)),
            "max_delta": float(np.max(deltas)), "positions": len(agree)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF directory or .gguf; default: embedded")
    p.add_argument("--quantization", default="int8,fp8")
    p.add_argument("--decode-rows", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    print(f"backend {jax.default_backend()}, {jax.devices()[0].device_kind}")
    ref = measure(args.model, None, args.decode_rows, args.repeats, None)
    print(f"{'weights':8} {'bytes':>12} {'x f32':>6} {'top-1':>7} {'mean|d|':>8} "
          f"{'max|d|':>7} {'step ms':>8} {'x f32':>6}")
    print(f"{'float32':8} {ref['bytes']:12,d} {1:6.3f} {'':>7} {'':>8} {'':>7} "
          f"{ref['step'] * 1e3:8.2f} {1:6.2f}")
    for name in args.quantization.split(","):
        got = measure(args.model, name, args.decode_rows, args.repeats, ref["ids"])
        c = compare(ref, got)
        print(f"{name:8} {got['bytes']:12,d} {got['bytes'] / ref['bytes']:6.3f} "
              f"{c['agreement']:7.2%} {c['mean_delta']:8.4f} {c['max_delta']:7.3f} "
              f"{got['step'] * 1e3:8.2f} {ref['step'] / got['step']:6.2f}")
    print(f"positions compared: {c['positions']} over {len(ref['ids'])} texts; step: "
          f"{args.decode_rows} decode rows, median of {args.repeats}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
