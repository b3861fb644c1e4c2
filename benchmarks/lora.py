"""Multi-LoRA throughput: output tok/s with 0, 1 and 4 adapters in the batch (docs/BENCHMARKS.md
§15).

    PYTHONPATH=. python benchmarks/lora.py [--requests 16] [--prompt-len 32] [--max-tokens 64]
        [--rank 16] [--repeats 2]

The default model (SmolLM2-135M, float32) serves the same greedy workload (`--requests` random
prompts of `--prompt-len` tokens, `--max-tokens` each, EOS ignored) four ways: an engine
without LoRA, and one engine with `enable_lora=True, max_loras=4` whose requests use no
adapter, one adapter, or four adapters in turn (request i uses adapter i mod 4). The adapters
are random rank-`--rank` PEFT directories on every projection, written to a temporary
directory. Every bucket the runs need is compiled by a first, untimed run of each (prefix
caching off, so every run steps through the same buckets); the timed
runs are interleaved `--repeats` times and the fastest of each kept (the shared machine's load
moves single runs by more than the effects).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from jaxengine import LLM, LoRARequest, SamplingParams
from jaxengine.loading.lora import LORA_MODULES, module_shapes
from jaxengine.model.config import ModelConfig

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_adapter(root: Path, cfg: ModelConfig, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory of small random weights on every projection of every layer."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for m in LORA_MODULES:
            fan_in, fan_out = module_shapes(cfg)[m]
            key = (f"base_model.model.model.layers.{layer}."
                   f"{'self_attn' if m in ATTENTION else 'mlp'}.{m}")
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, 0.01, (rank, fan_in)).astype(
                np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.01, (fan_out, rank)).astype(
                np.float32)
    root.mkdir(parents=True)
    save_file(tensors, str(root / "adapter_model.safetensors"))
    (root / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
         "target_modules": list(LORA_MODULES), "bias": "none"}))
    return root


def timed(llm: LLM, prompts: list[dict], params: SamplingParams,
          loras: list[LoRARequest | None] | None) -> tuple[float, int]:
    """Seconds of one `generate` of the workload, and the output tokens it made."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    a = parser.parse_args()
    # No prefix caching: a repeated run would hit the first one's prompt blocks and step in
    # other token buckets than the untimed run compiled.
    engine = dict(max_num_seqs=a.requests, max_num_batched_tokens=512, precompile=False,
                  max_model_len=a.prompt_len + a.max_tokens + 16, enable_prefix_caching=False)
    plain = LLM(**engine)
    lora = LLM(**engine, enable_lora=True, max_loras=4, max_lora_rank=a.rank)
    cfg = ModelConfig.smollm2_135m()
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, cfg.vocab_size, a.prompt_len).tolist()}
               for _ in range(a.requests)]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"a{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", cfg,
                                                                  a.rank, i)))
                    for i in range(4)]
        runs = {"no LoRA (enable_lora=False)": (plain, None),
                "enable_lora, 0 adapters": (lora, None),
                "enable_lora, 1 adapter": (lora, [adapters[0]] * a.requests),
                "enable_lora, 4 adapters": (lora, [adapters[i % 4] for i in range(a.requests)])}
        for llm, loras in runs.values():  # compile what the runs need
            timed(llm, prompts, params, loras)
        best = dict.fromkeys(runs, float("inf"))
        tokens = 0
        for _ in range(a.repeats):
            for name, (llm, loras) in runs.items():
                seconds, tokens = timed(llm, prompts, params, loras)
                best[name] = min(best[name], seconds)
    base = best["no LoRA (enable_lora=False)"]
    print(f"{a.requests} requests x {a.max_tokens} tokens, prompts of {a.prompt_len}, "
          f"rank {a.rank}; fastest of {a.repeats}")
    for name, seconds in best.items():
        print(f"{name:30s} {seconds:7.2f} s  {tokens / seconds:7.1f} tok/s  "
              f"x{base / seconds:.2f}")


if __name__ == "__main__":
    main()
