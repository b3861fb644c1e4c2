"""Child process of test_compilation_cache.py: one tiny engine, with the persistent cache at a
given directory ('' disables), precompiled, on a small greedy workload.

    python compilation_cache_child.py CACHE_DIR DTYPE

prints one JSON line: the tokens and cumulative logprobs of each prompt, the engine programs
compiled (loaded ones included) and loaded from the cache in this process, the buckets, and the
runner's compilations after warm-up (debug_recompiles is on, so a stall would raise instead).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jaxengine import LLM, SamplingParams
from jaxengine.runner import compiles
from jaxengine.runner.programs import SAMPLE_NAME, STEP_NAME

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny" / "llama_tied_mha"
PROMPTS = [[(7 * i + 3 * j) % 100 + 1 for j in range(n)] for i, n in enumerate((3, 29, 8))]


def main(cache_dir: str, dtype: str) -> None:
    """Run the workload and print its JSON line."""
    llm = LLM(str(TINY), dtype=dtype, compilation_cache_dir=cache_dir, skip_tokenizer_init=True,
              precompile=True, debug_recompiles=True, max_num_batched_tokens=32,
              max_num_seqs=4, block_size=4, max_model_len=128)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    runner = llm.llm_engine.runner
    runner.wait_for_programs()  # LLM() leaves the buckets a first request does not need
    print(json.dumps({
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [o.outputs[0].cumulative_logprob for o in outs],
        "compiled": compiles.compile_count(STEP_NAME, SAMPLE_NAME),
        "cache_hits": compiles.cache_hit_count(STEP_NAME, SAMPLE_NAME),
        "buckets": len(runner.token_buckets) + len(runner.request_buckets),
        "after_warmup": runner.stats.compilations_after_warmup,
    }))


if __name__ == "__main__":
    main(*sys.argv[1:])
