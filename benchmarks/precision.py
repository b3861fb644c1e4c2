"""Precision (docs/BENCHMARKS.md §13): how good, how small and how fast the default model is
with quantized weights (`quantization=`) and a quantized KV cache (`kv_cache_dtype=`), each
against float32, all in one run. The report opens with the CPU kernels' path and the CPU.

    python benchmarks/precision.py [--variants f32,int8,gguf,kv-bf16,kv-fp8]  # also: fp8 (weights)
        [--sections accuracy,memory,speed] [--rounds 2] [--decode-requests 64]

- accuracy: teacher-forced over fixed texts (the golden chat prompt with its greedy answer, and
  two paragraphs of prose): at every position the variant's most likely next token against
  float32's (top-1 agreement) and |Δ logprob| of the text's actual next token, from
  `prompt_logprobs=1` (the prompt's tokens scored one forward pass at a time, as a user gets
  them).
- memory: bytes of the model's weights on the device (the engine's parameter arrays, the tied
  embedding / LM head included) and the KV pool's blocks in the same `kv_cache_memory_bytes`.
- speed: output tokens/s of mix64 (benchmarks/workloads/mix64.json) and of a decode-heavy
  workload (`--decode-requests` requests of 32-token prompts and 256 outputs), each variant an
  `LLM` built as a user builds it (warmed up at build), the variants' runs interleaved over
  `--rounds` rounds so that a neighbour's load falls on all of them alike; the best round of
  each is reported with its ratio to float32's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from throughput import DEFAULT_WORKLOAD, cpu_kernels, load_workload  # this folder

REPO = Path(__file__).resolve().parents[1]
# Each variant: LLM keyword arguments beside `dtype="float32"`. "f32" is the reference: the
# GGUF file dequantized to float32 weights, a float32 KV cache.
VARIANTS: dict[str, dict[str, Any]] = {
    "f32": {"quantization": None},
    "int8": {"quantization": "int8"},
    "fp8": {"quantization": "fp8"},
    "gguf": {"quantization": "gguf"},
    "kv-bf16": {"quantization": None, "kv_cache_dtype": "bfloat16"},
    "kv-fp8": {"quantization": None, "kv_cache_dtype": "fp8"},
}
PROSE = [
    "The river had been rising for three days before anyone in the village thought to move "
    "the grain. By the time the first carts reached the hill, the lower fields were already "
    "under water, and the old mill, which had stood for two hundred years, groaned as the "
    "current pressed against its wheel. Children carried what they could; the elders argued "
    "about whether the bridge would hold.",
    "A hash table stores key-value pairs in an array of buckets. To insert a key, the table "
    "computes a hash of the key, reduces it modulo the number of buckets, and places the pair "
    "in that bucket. When two keys land in the same bucket, the table resolves the collision, "
    "either by chaining the pairs in a list or by probing for the next free slot. As the table "
    "fills, it grows and rehashes every key.",
]
KV_BUDGET = 512 << 20  # the memory section's pool: the same bytes for every cache dtype


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """Print `rows` under `header`, columns padded to their widest cell."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


def texts(tokenizer: Any) -> list[list[int]]:
    """Token ids of the fixed texts: the golden chat prompt + its greedy answer, the prose."""
    golden = json.loads((REPO / "tests/fixtures/default/greedy.json").read_text())
    return [golden["prompt_ids"] + golden["greedy_ids"]] + [
        tokenizer.encode(p) for p in PROSE]


def teacher_forced(llm: Any, ids: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per text: (the most likely token at each position i32[S-1], the logprob of the text's
    next token f32[S-1]) from the engine's prompt logprobs."""
    from scheduler import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": t} for t in ids], params, use_tqdm=False)
    result = []
    for text, out in zip(ids, outs, strict=True):
        positions = out.prompt_logprobs[1:]  # position 0 has no prediction
        top = [next(t for t, lp in pos.items() if lp.rank == 1) for pos in positions]
        actual = [pos[tok].logprob for pos, tok in zip(positions, text[1:], strict=True)]
        result.append((np.array(top), np.array(actual, np.float32)))
    return result


def weight_bytes(llm: Any) -> int:
    """Bytes of the engine's model weights on its devices (every parameter array)."""
    import jax

    return sum(leaf.nbytes for leaf in jax.tree.leaves(llm._replicas[0].runner.model.params))


def decode_heavy(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` requests of 32 random token ids (ids 1000..20000 of SmolLM2's vocabulary) and 256
    outputs each."""
    rng = np.random.default_rng(seed)
    return [{"id": f"d{i}", "prompt_token_ids": rng.integers(1000, 20000, 32).tolist(),
             "max_tokens": 256} for i in range(n)]


def timed(llm: Any, requests: list[dict[str, Any]]) -> float:
    """Output tokens/s of `requests` (greedy, exactly max_tokens each) through `llm.generate`."""
    from scheduler import SamplingParams

    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
              for r in requests]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in requests], params,
                        use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def build(name: str, **extra: Any) -> Any:
    from jaxengine import LLM

    t0 = time.perf_counter()
    llm = LLM(dtype="float32", **VARIANTS[name], **extra)
    # LLM() leaves most buckets to a background thread: a timed run must not share the cores
    # with their compiles (float32's mix64 beside its own ran at 41.7 tok/s, after them 116.1)
    llm.llm_engine.runner.wait_for_programs()
    print(f"built {name} in {time.perf_counter() - t0:.0f} s", flush=True)
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="f32,int8,gguf,kv-bf16,kv-fp8")
    parser.add_argument("--sections", default="accuracy,memory,speed")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--decode-requests", type=int, default=64)
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    args = parser.parse_args()
    names, sections = args.variants.split(","), args.sections.split(",")
    print(f"CPU kernels: {cpu_kernels()}", flush=True)
    # Warmed up at build only when timed (LLM() compiles every bucket then, as a user gets it).
    llms = {name: build(name, precompile="speed" in sections) for name in names}
    if "accuracy" in sections:
        ids = texts(next(iter(llms.values())).get_tokenizer())
        ref = teacher_forced(llms["f32"], ids)
        rows = []
        for name in names:
            got = teacher_forced(llms[name], ids)
            agree = np.concatenate([g[0] == r[0] for g, r in zip(got, ref, strict=True)])
            delta = np.concatenate([np.abs(g[1] - r[1]) for g, r in zip(got, ref, strict=True)])
            rows.append([name, f"{agree.mean():.2%}", f"{delta.mean():.4f}", f"{delta.max():.3f}",
                         str(agree.size)])
        table("accuracy against f32, teacher-forced",
               ["variant", "top-1 agreement", "mean |Δ logprob|", "max |Δ|", "positions"], rows)
    if "memory" in sections:
        base = weight_bytes(llms["f32"])
        rows = []
        for name in names:
            size = weight_bytes(llms[name])
            kv = build(name, kv_cache_memory_bytes=KV_BUDGET, precompile=False)
            blocks = kv.llm_engine.scheduler_config.num_blocks
            rows.append([name, f"{size / 2**20:.1f}", f"{size / base:.3f}", str(blocks)])
            del kv
        table(f"weights on the device; KV blocks in {KV_BUDGET >> 20} MiB",
               ["variant", "weights MiB", "x f32", "KV blocks"], rows)
    if "speed" in sections:
        workloads = {"mix64": load_workload(args.workload, None),
                     "decode-heavy": decode_heavy(args.decode_requests)}
        best: dict[tuple[str, str], float] = {}
        for r in range(args.rounds):
            for wname, requests in workloads.items():
                for name in names:
                    rate = timed(llms[name], requests)
                    print(f"round {r} {wname} {name}: {rate:.1f} out tok/s", flush=True)
                    best[wname, name] = max(best.get((wname, name), 0.0), rate)
        rows = [[w, n, f"{best[w, n]:.1f}", f"{best[w, n] / best[w, 'f32']:.2f}"]
                for w in workloads for n in names]
        table(f"speed, best of {args.rounds} interleaved rounds",
               ["workload", "variant", "out tok/s", "x f32"], rows)


if __name__ == "__main__":
    main()
