"""KV offloading to host memory (docs/BENCHMARKS.md §7): a workload whose shared prefixes do not
fit the device pool's prefix cache, run without and with `kv_offloading_size`, in one process.

    python benchmarks/kv_offload.py [--model DIR] [--num-prefixes 4] [--prefix-tokens 256]
        [--rounds 3] [--num-gpu-blocks 40] [--kv-offloading-size 0.25] [--repeats 3] [--json]

`--num-prefixes` distinct prefixes (random token ids) of `--prefix-tokens` tokens are asked
round-robin, `--rounds` times, each with a short suffix of its own and 8 greedy tokens, one
request at a time. With a pool of `--num-gpu-blocks` blocks (null block included) the device
keeps about one or two prefixes cached, so round-robin reuse misses the device cache every time
(LRU's worst case); the host store keeps them all. Both engines are built and precompiled
first, then run the workload `--repeats` times, alternating, each time with new prefixes (so
neither cache starts with them), so that other load on a shared machine falls on both alike;
the times are the medians. The default model is the embedded SmolLM2-135M (float32).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import build_engine
from jaxengine.engine.stats import IterationStats
from scheduler import SamplingParams, SchedulerStats

MAX_TOKENS = 8


class Transfers:
    """A stat logger that sums the engine's offloading transfers by direction."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.seconds: dict[str, float] = {}

    def record(self, scheduler_stats: SchedulerStats,
               iteration_stats: IterationStats | None) -> None:
        for t in () if iteration_stats is None else iteration_stats.kv_offload_transfers:
            self.bytes[t.transfer_type] = self.bytes.get(t.transfer_type, 0) + t.num_bytes
            self.seconds[t.transfer_type] = self.seconds.get(t.transfer_type, 0.0) + t.seconds


def workload(num_prefixes: int, prefix_tokens: int, rounds: int, vocab: int, seed: int
             ) -> list[list[int]]:
    """The prompts, in arrival order: prefix i of each round, then the next one."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, vocab) for _ in range(prefix_tokens)]
                for _ in range(num_prefixes)]
    return [prefixes[i] + [rng.randrange(1, vocab) for _ in range(6)]
            for _ in range(rounds) for i in range(num_prefixes)]


def build(args: EngineArgs) -> tuple[Any, Transfers, float]:
    """An engine, precompiled; its transfer logger; the seconds it took."""
    t0 = time.perf_counter()
    engine = build_engine(args)
    engine.runner.precompile(progress=False)
    transfers = Transfers()
    engine.stat_loggers.append(transfers)
    return engine, transfers, time.perf_counter() - t0


def run(engine: Any, transfers: Transfers, prompts: list[list[int]]) -> dict[str, Any]:
    """Serve every prompt on a warm engine; what it computed, hit and moved meanwhile."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    before, computed = engine.state.counters, engine.runner.stats.computed_tokens
    transfers.bytes, transfers.seconds = {}, {}
    outputs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    seconds = time.perf_counter() - t0
    c = engine.state.counters
    decode = len(prompts) * (MAX_TOKENS - 1)  # each request's tokens after its prompt's
    return dict(
        seconds=seconds, prompt_tokens=sum(len(p) for p in prompts),
        computed_prompt_tokens=engine.runner.stats.computed_tokens - computed - decode,
        device_hit_tokens=c.prefix_cache_hits - before.prefix_cache_hits,
        host_hit_tokens=c.connector_prefix_cache_hits - before.connector_prefix_cache_hits,
        bytes_to_host=transfers.bytes.get("GPU_to_CPU", 0),
        bytes_to_device=transfers.bytes.get("CPU_to_GPU", 0),
        load_seconds=round(transfers.seconds.get("CPU_to_GPU", 0.0), 3),
        save_seconds=round(transfers.seconds.get("GPU_to_CPU", 0.0), 3),
        compilations_after_warmup=engine.runner.stats.compilations_after_warmup,
        outputs=[outputs[f"r{i}"] for i in range(len(prompts))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: embedded)")
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-gpu-blocks", type=int, default=40)
    ap.add_argument("--kv-offloading-size", type=float, default=0.25, help="GiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args()
    max_model_len = min(512, (a.num_gpu_blocks - 1) * 16)
    base = EngineArgs(model=a.model, skip_tokenizer_init=True, block_size=16, max_num_seqs=1,
                      num_gpu_blocks_override=a.num_gpu_blocks, max_model_len=max_model_len,
                      max_num_batched_tokens=min(256, max_model_len))
    engines = {"off": build(base),
               "on": build(EngineArgs(**{**_fields(base),
                                         "kv_offloading_size": a.kv_offloading_size}))}
    vocab = engines["off"][0].vocab_size
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for r in range(a.repeats):
        prompts = workload(a.num_prefixes, a.prefix_tokens, a.rounds, vocab, seed=r)
        for mode, (engine, transfers, _) in engines.items():
            runs[mode].append(run(engine, transfers, prompts))
    same = all(x.pop("outputs") == y.pop("outputs") for x, y in zip(*runs.values(), strict=True))
    results = {}
    for mode, rs in runs.items():
        results[mode] = dict(rs[-1], seconds=round(statistics.median(x["seconds"] for x in rs), 2),
                             all_seconds=[round(x["seconds"], 2) for x in rs],
                             build_seconds=round(engines[mode][2], 1))
    if a.json:
        print(json.dumps(dict(results, same_outputs=same)))
        return
    print(f"{a.num_prefixes * a.rounds} requests: {a.num_prefixes} prefixes x "
          f"{a.prefix_tokens} tokens, {a.rounds} rounds; pool {a.num_gpu_blocks} blocks of 16; "
          f"{a.repeats} repeats (counts: the last one; seconds: median); same outputs: {same}")
    print(f"  {'':28s} {'off':>14} {'on':>14}")
    for key in results["off"]:
        print(f"  {key:28s} {results['off'][key]!s:>14} {results['on'][key]!s:>14}")
    off, on = results["off"], results["on"]
    print(f"summary: with offloading {on['computed_prompt_tokens']} of {on['prompt_tokens']} "
          f"prompt tokens computed (without: {off['computed_prompt_tokens']}), "
          f"{on['host_hit_tokens']} loaded from the host; median time on/off "
          f"{on['seconds'] / off['seconds']:.2f}")


def _fields(args: EngineArgs) -> dict[str, Any]:
    return {name: getattr(args, name) for name in args.__dataclass_fields__}


if __name__ == "__main__":
    main()
