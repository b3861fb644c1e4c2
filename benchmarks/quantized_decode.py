"""A decode-heavy run through `LLM.generate` with float32, int8 and GGUF-block weights
(docs/BENCHMARKS.md §2, "Quantized projections").

    PYTHONPATH=. python benchmarks/quantized_decode.py [--requests 64] [--prompt 32]
        [--outputs 256] [--quantizations none,int8,gguf]

The embedded SmolLM2-135M (a Q4_1 GGUF: "none" is its float32 load, "int8" those floats
quantized per channel, "gguf" its Q4_1 / Q8_0 blocks served as they are), each engine built
with `LLM()`'s defaults, precompiled, then given `--requests` prompts of `--prompt` random
token ids at once (greedy, ignore_eos, exactly `--outputs` tokens each). Prints the wall time
and output tok/s of each, one after another in one process, after the kernels' path and the
CPU: figures of different paths or CPUs do not compare.
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from benchmarks.throughput import cpu_kernels
from jaxengine import LLM, SamplingParams


def run(quantization: str | None, prompts: list[dict], outputs: int) -> float:
    """Output tok/s of one engine on `prompts`."""
    llm = LLM(quantization=quantization)
    params = SamplingParams(max_tokens=outputs, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    done = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(out.outputs[0].token_ids) for out in done)
    assert tokens == len(prompts) * outputs
    del llm
    gc.collect()
    print(f"quantization={quantization}: {seconds:.1f} s, {tokens / seconds:.1f} out tok/s",
          flush=True)
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--outputs", type=int, default=256)
    parser.add_argument("--quantizations", default="none,int8,gguf")
    args = parser.parse_args()
    print(f"CPU kernels: {cpu_kernels()}")
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 40000, args.prompt).tolist()}
               for _ in range(args.requests)]
    rates = {q: run(None if q == "none" else q, prompts, args.outputs)
             for q in args.quantizations.split(",")}
    base = rates.get("none")
    if base:
        print("  ".join(f"{q} {r / base:.2f}x" for q, r in rates.items()))


if __name__ == "__main__":
    main()
