"""`make demo`: the embedded default model on a few chat prompts with continuous batching.

Half of the questions are queued at the start, the rest join while the first ones are still
decoding (continuous batching: they share steps with running requests). Each answer is printed
as it finishes, then the throughput.
"""

from __future__ import annotations

import sys
import time

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
    from jaxengine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024)
    engine, tokenizer = llm.llm_engine, llm.get_tokenizer()
    print(f"loaded the default model in {time.perf_counter() - t0:.1f}s")
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
    stats = engine.runner.stats
    print(f"\n{generated} tokens in {elapsed:.1f}s over {steps} steps: "
          f"{generated / elapsed:.1f} tokens/s, including {stats.compile_seconds:.1f}s in the "
          f"steps that compiled ({stats.compilations} programs, once per process)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
