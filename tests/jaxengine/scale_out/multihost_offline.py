"""One process of the two-process offline test (test_multihost_processes.py); not a test module.

`python multihost_offline.py PROCESS_ID COORDINATOR TP [ENGINE_KWARGS_JSON]` (its "model" key,
if any, replaces MODEL): builds an `LLM`
joined to the others through `jax.distributed`, prints `LAYOUT {json}` (which processes hold
the KV cache and the largest weight, and whether each device holds only a part of them), then
generates `PROMPTS` with `PARAMS` and prints `RESULT {json}`: each output's token ids, text
and logprobs. A `ValueError` while building prints `VALUE_ERROR message` instead (exit
status 3).
"""

from __future__ import annotations

import faulthandler
import json
import signal
import sys
from typing import Any

import jax

from jaxengine.llm import LLM
from scheduler import SamplingParams

MODEL = "tests/fixtures/tiny/llama3_gqa"
ENGINE = dict(max_num_batched_tokens=32, max_num_seqs=4, block_size=4, max_model_len=128,
              num_gpu_blocks_override=80)
PROMPTS = [{"prompt_token_ids": [1, 5, 9]}, "hello world", {"prompt_token_ids": list(range(3, 40))},
           "a b c d", {"prompt_token_ids": [7] * 9}]
PARAMS = [SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True),
          SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True),
          SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, ignore_eos=True),
          SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)]


def summarize(llm: LLM) -> list[dict]:
    """Generate the fixed workload; each output's tokens, text and sampled-token logprobs."""
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    rows = []
    for out in outs:
        c = out.outputs[0]
        lps = [None if d is None else d[t].logprob for t, d in zip(c.token_ids, c.logprobs or
               [None] * len(c.token_ids), strict=True)]
        rows.append({"token_ids": list(c.token_ids), "text": c.text, "logprobs": lps})
    return rows


def layout(llm: LLM) -> dict[str, Any]:
    """Where the KV cache and the largest weight live, and whether they are really split."""
    runner = llm.llm_engine.runner
    weight = max(jax.tree.leaves(runner.model.params), key=lambda x: x.size)
    return {name: {"processes": sorted({d.process_index for d in x.sharding.device_set}),
                   "devices": len(x.sharding.device_set),
                   "split": x.addressable_shards[0].data.size < x.size}
            for name, x in (("kv", runner.kv), ("weight", weight))}


def main() -> int:
    process_id, coordinator, tp = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    model = extra.pop("model", MODEL)
    try:
        llm = LLM(model, **{**ENGINE, **extra}, tensor_parallel_size=tp,
                  coordinator_address=coordinator, num_processes=2, process_id=process_id)
    except ValueError as e:
        print("VALUE_ERROR", e, flush=True)
        return 3
    print("LAYOUT", json.dumps(layout(llm)), flush=True)
    print("RESULT", json.dumps(summarize(llm)), flush=True)
    return 0


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1)  # the test's timeout asks for every thread's stack
    sys.exit(main())
