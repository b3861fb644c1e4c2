"""The transformers side of `benchmarks/throughput.py --compare hf` (docs/BENCHMARKS.md §2).

Runs in its own interpreter, a Python 3.11 venv with a CPU torch (the project's venv has no
torch), on the same GGUF weights, float32:

    .venv311/bin/python benchmarks/hf_baseline.py --gguf FILE --workload W.json --limits 16,0
        [--hf-static]

For each limit (the first N requests; 0: all) it runs transformers' continuous batching (and,
with --hf-static, `generate` in batches of 8), greedy with EOS off, and prints one line
`HF_RESULT {json}` that throughput.py reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from throughput import load_workload, parse_limits  # this folder: the one workload reader


def hf_worker(args: argparse.Namespace) -> None:
    """Run each limit of the workload with transformers; print one JSON line of results."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    folder, fname = os.path.split(args.gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname,
                                                 dtype=torch.float32).eval()
    result: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "limits": {}}
    for limit in parse_limits(args.limits):
        requests = load_workload(Path(args.workload), limit)
        res: dict[str, Any] = {}
        config = GenerationConfig(do_sample=False,
                                  max_new_tokens=max(r["max_tokens"] for r in requests))
        try:
            res["cb"] = _hf_continuous_batching(model, config, requests)
        except Exception as e:  # report and go on: the other limits are still useful
            res["cb_error"] = f"{type(e).__name__}: {e}"
        if args.hf_static:
            res["static8"] = _hf_static_batches(model, requests, batch_size=8)
        result["limits"][str(len(requests))] = res
    print("HF_RESULT " + json.dumps(result))


def _hf_continuous_batching(model: Any, config: Any, requests: list[dict[str, Any]]
                            ) -> dict[str, Any]:
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    start = time.time()
    try:
        for r in requests:
            manager.add_request(r["prompt_token_ids"], request_id=r["id"],
                                max_new_tokens=r["max_tokens"], eos_token_id=-1)
        tokens, done = 0, set()
        while len(done) < len(requests):
            out = manager.get_result(timeout=600)
            if out is None:
                raise RuntimeError("continuous batching stopped before finishing")
            if out.is_finished() and out.request_id not in done:
                done.add(out.request_id)
                tokens += len(out.generated_tokens)
    finally:
        manager.stop(block=True)
    return {"elapsed": time.time() - start, "output_tokens": tokens}


def _hf_static_batches(model: Any, requests: list[dict[str, Any]], batch_size: int
                       ) -> dict[str, Any]:
    import torch

    start, tokens = time.time(), 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r["prompt_token_ids"]) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, r in enumerate(batch):
            p = r["prompt_token_ids"]
            ids[b, width - len(p):] = torch.tensor(p)
            mask[b, width - len(p):] = 1
        n = max(r["max_tokens"] for r in batch)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)
        tokens += sum(r["max_tokens"] for r in batch)  # useful tokens only
    return {"elapsed": time.time() - start, "output_tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments throughput.py passes and run `hf_worker`."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--limits", required=True)
    p.add_argument("--hf-static", action="store_true")
    hf_worker(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
