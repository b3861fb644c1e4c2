"""`make demo`: the embedded default model on a few chat prompts with continuous batching.

Half of the questions are queued at the start, the rest join while the first ones are still
decoding (continuous batching: they share steps with running requests). Each answer is printed
as it finishes, then the throughput. Before them it says how long `LLM()` took to compile its
programs, or to load them from the persistent compilation cache (warm on a second run): which
of the two is counted from JAX's cache-hit events, not guessed from the directory.
"""

from __future__ import annotations

import sys
import time

from jaxengine import LLM, SamplingParams
from jaxengine.runner import compilation_cache, compiles
from jaxengine.runner.compilation_cache import cache_state, shown
from jaxengine.runner.programs import SAMPLE_NAME, STEP_NAME

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Explain what a neural network is in two sentences.",
    "Write a haiku about the ocean.",
    "What is 12 times 7?",
    "Name three primary colors.",
]


def main() -> int:
    """Run the demo; returns the process exit status."""
    compiles.ensure_listener()
    hits_before = compiles.cache_hit_count(STEP_NAME, SAMPLE_NAME)
    t0 = time.perf_counter()
    llm = LLM(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024)
    engine, tokenizer = llm.llm_engine, llm.get_tokenizer()
    stats = engine.runner.stats  # LLM() compiled (or loaded) every bucket: compile_seconds
    print(f"loaded the default model in {time.perf_counter() - t0 - stats.compile_seconds:.1f}s")
    print(compile_summary(stats.compilations,
                          compiles.cache_hit_count(STEP_NAME, SAMPLE_NAME) - hits_before,
                          stats.compile_seconds, compilation_cache.active_dir()))
    params = SamplingParams(max_tokens=96, temperature=0.0)
    pending = [(str(i), q) for i, q in enumerate(QUESTIONS)]
    start, steps, generated = time.perf_counter(), 0, 0
    while pending or engine.has_unfinished_requests():
        if pending and (steps == 0 or steps == 8):  # a second wave joins mid-flight
            wave, pending = pending[:3], pending[3:]
            for rid, question in wave:
                prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}])
                engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                generated += len(out.outputs[0].token_ids)
                print(f"\n[{out.request_id}] Q: {QUESTIONS[int(out.request_id)]}")
                print(f"    A: {out.outputs[0].text.strip()}")
                print(f"    ({len(out.outputs[0].token_ids)} tokens, "
                      f"TTFT {out.metrics.ttft:.2f}s, {out.outputs[0].finish_reason})")
        steps += 1
    elapsed = time.perf_counter() - start
    late = stats.compilations_after_warmup  # 0 after LLM()'s precompile
    print(f"\n{generated} tokens in {elapsed:.1f}s over {steps} steps: "
          f"{generated / elapsed:.1f} tokens/s"
          + (f", {late} programs compiled during the steps" if late else ""))
    return 0


def compile_summary(programs: int, loaded: int, seconds: float, cache_dir: str | None) -> str:
    """One line on the engine's programs: compiled, or loaded from the persistent cache.

    Args:
      programs: the step's and sampler's programs this run got (loaded ones included).
      loaded: of those, read from the persistent cache (counted cache hits).
      seconds: time in precompile and the steps that compiled.
      cache_dir: the cache directory; None: the cache is disabled.
    """
    if cache_dir is None:
        return f"compiled {programs} programs in {seconds:.1f}s (persistent cache disabled)"
    where = shown(cache_dir)
    if programs == 0:
        return f"no programs compiled (cache: {where})"
    state = cache_state(loaded, programs)
    if state == "cold":
        return (f"compiled {programs} programs in {seconds:.1f}s (cache cold: {where}; the "
                f"next run loads them)")
    if state == "warm":
        return f"loaded {programs} programs from the cache in {seconds:.1f}s (cache warm: {where})"
    return (f"compiled {programs - loaded} and loaded {loaded} programs from the cache in "
            f"{seconds:.1f}s (cache partly warm: {where})")


if __name__ == "__main__":
    sys.exit(main())
