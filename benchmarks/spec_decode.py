"""Speculative decoding, ngram (docs/BENCHMARKS.md §8): steps and output tokens/s without and
with `speculative_config`, on repetitive text and on the mix64 workload, in one process.

    python benchmarks/spec_decode.py [--model DIR] [--num-requests 8] [--mix-requests 8]
        [--num-speculative-tokens 3] [--prompt-lookup-min 2] [--prompt-lookup-max 4]
        [--repeats 2] [--json]

Each workload runs on four engines over the same loaded weights: the synchronous loop
(`async_scheduling=False`), the default asynchronous loop, and ngram speculation in each
(`ngram`: synchronous; `ngram-async`: async scheduling, where a step that verifies drafts is
collected before the next is planned, docs/DESIGN.md "Speculative decoding"). `steps` counts
device steps, `calls` the engine's `step()` calls (one with an empty plan runs no device
step). Every request is
greedy, ignores EOS and arrives at t=0. Each timed run is a fresh engine (no prefix-cache
hits from the one before) over programs compiled before it starts, so the times are steps
only (any compilation after warm-up is counted); the kinds run interleaved `--repeats` times
and the fastest run of each is reported, since the shared machine's load moves single runs by
more than the effect. `tok/req-step` is output tokens per (request,
step that gave it tokens): 1 without speculation, 1 + the accepted drafts with it. The
repetitive workload asks the model to continue text that repeats itself (`--num-requests`
prompts, 64 tokens each); mix64 is `benchmarks/workloads/mix64.json`'s first
`--mix-requests` requests. Greedy outputs must be identical with and without speculation: the
script says so. The default model is the embedded SmolLM2-135M (float32).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import resolve_config
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine.stats import IterationStats
from scheduler import SamplingParams, SchedulerStats

MIX64 = Path(__file__).resolve().parent / "workloads" / "mix64.json"
REPEATED = ["The cat sat on the mat. ", "for i in range(10):\n    print(i)\n",
            "red, green, blue, ", "Monday Tuesday Wednesday Thursday Friday ",
            "<li>item</li>\n", "1 2 3 4 5 6 7 8 9 10 ", "SELECT name FROM users; ",
            "yes no yes no "]


class Accepted:
    """A stat logger summing the steps' drafts and accepted tokens."""

    def __init__(self) -> None:
        self.drafts = self.draft_tokens = self.accepted = 0

    def record(self, scheduler_stats: SchedulerStats,
               iteration_stats: IterationStats | None) -> None:
        s = None if iteration_stats is None else iteration_stats.spec_decoding
        if s is not None:
            self.drafts += s.num_drafts
            self.draft_tokens += s.num_draft_tokens
            self.accepted += s.num_accepted_tokens


def repetitive(tokenizer: Any, n: int) -> list[dict[str, Any]]:
    """`n` prompts of a phrase repeated six times, 64 output tokens each."""
    return [{"id": f"rep{i}", "prompt_token_ids": tokenizer.encode(REPEATED[i % len(REPEATED)]
                                                                   * 6), "max_tokens": 64}
            for i in range(n)]


def mix64(n: int) -> list[dict[str, Any]]:
    """The first `n` requests of mix64 (token ids of SmolLM2's vocabulary)."""
    with open(MIX64) as f:
        data = json.load(f)
    requests = data["requests"] if isinstance(data, dict) else data
    return [dict(r, id=str(r.get("id", i))) for i, r in enumerate(requests[:n])]


def load(model: str | None) -> tuple[Any, Any, Any]:
    """The model's functions (loaded once: engines over them share compiled programs), its
    config and its tokenizer."""
    from jaxengine.engine.build import attention_backend, model_fns
    from jaxengine.loading.load import load_model
    from jaxengine.model.mesh import engine_devices, make_mesh

    model, cfg, tokenizer = load_model(model, dtype="float32", mesh=make_mesh(engine_devices(1)))
    return model_fns(model, cfg, attn_impl=attention_backend(EngineArgs(), cfg)), cfg, tokenizer


def run(args: argparse.Namespace, fns: Any, cfg: Any, tokenizer: Any,
        requests: list[dict[str, Any]], *, precompile: bool, **kw: Any) -> dict[str, Any]:
    """Build a fresh engine (no prefix-cache hits from an earlier run), warm it, run the
    requests to the end; timings and counters. `precompile=False`: an engine of the same
    shapes compiled the programs before (jit's cache holds them), so it is only declared warm."""
    ea = EngineArgs(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                    max_num_batched_tokens=args.max_num_batched_tokens, **kw)
    engine = LLMEngine(fns, ea, resolve_config(ea, fns, cfg), tokenizer=tokenizer)
    if precompile:
        engine.runner.precompile(progress=False)
    else:
        engine.runner.mark_warm()
    counts = Accepted()
    engine.stat_loggers.append(counts)
    steps0 = engine.runner.stats.steps
    start = time.perf_counter()
    for r in requests:
        engine.add_request(r["id"], {"prompt_token_ids": r["prompt_token_ids"]},
                           SamplingParams(max_tokens=r["max_tokens"], temperature=0.0,
                                          ignore_eos=True))
    outputs, request_steps, seen = {}, 0, dict.fromkeys((r["id"] for r in requests), 0)
    calls = 0
    while engine.has_unfinished_requests():
        calls += 1
        for o in engine.step():
            n = len(o.outputs[0].token_ids)
            request_steps += n > seen[o.request_id]  # a step that gave this request tokens
            seen[o.request_id] = n
            if o.finished:
                outputs[o.request_id] = list(o.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    tokens = sum(map(len, outputs.values()))
    return dict(elapsed=elapsed, output_tokens=tokens, tokens_per_s=tokens / elapsed,
                steps=engine.runner.stats.steps - steps0, calls=calls,
                tokens_per_request_step=tokens / max(request_steps, 1), drafts=counts.drafts,
                draft_tokens=counts.draft_tokens, accepted=counts.accepted,
                compilations_after_warmup=engine.runner.stats.compilations_after_warmup,
                outputs=outputs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2-135M)")
    p.add_argument("--num-requests", type=int, default=8, help="repetitive-text requests")
    p.add_argument("--mix-requests", type=int, default=8, help="mix64 requests (0: skip)")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2,
                   help="timed runs of each engine, interleaved; the fastest is reported")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = p.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max}
    fns, cfg, tokenizer = load(args.model)
    workloads = {"repetitive": repetitive(tokenizer, args.num_requests)}
    if args.mix_requests:
        workloads["mix64"] = mix64(args.mix_requests)
    results: dict[str, dict[str, Any]] = {}
    print(f"speculative_config={json.dumps(spec)}")
    print(f"{'workload':<11} {'engine':<11} {'steps':>6} {'calls':>6} {'tok/req-step':>12} "
          f"{'out tok':>8} "
          f"{'tok/s':>7} {'accepted/drafted':>17} {'compiles':>8}")
    kinds = {"sync": dict(async_scheduling=False), "async": dict(async_scheduling=True),
             "ngram": dict(speculative_config=spec, async_scheduling=False),
             "ngram-async": dict(speculative_config=spec, async_scheduling=True)}
    for name, requests in workloads.items():
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
        for i in range(args.repeats):
            for kind, kw in kinds.items():
                runs[kind].append(run(args, fns, cfg, tokenizer, requests,
                                      precompile=i == 0 and name == next(iter(workloads)),
                                      **kw))
        res = {k: min(rs, key=lambda r: r["elapsed"]) for k, rs in runs.items()}
        for engine, r in res.items():
            acc = f"{r['accepted']}/{r['draft_tokens']}" if "ngram" in engine else "-"
            print(f"{name:<11} {engine:<11} {r['steps']:>6} {r['calls']:>6} "
                  f"{r['tokens_per_request_step']:>12.2f} "
                  f"{r['output_tokens']:>8} {r['tokens_per_s']:>7.1f} {acc:>17} "
                  f"{sum(x['compilations_after_warmup'] for x in runs[engine]):>8}")
        same = all(r["outputs"] == res["sync"]["outputs"] for rs in runs.values() for r in rs)
        ng, sy, na, asy = res["ngram"], res["sync"], res["ngram-async"], res["async"]
        print(f"{name}: ngram / sync: steps x{ng['steps'] / sy['steps']:.2f}, tokens/s "
              f"x{ng['tokens_per_s'] / sy['tokens_per_s']:.2f}; ngram / async tokens/s "
              f"x{ng['tokens_per_s'] / asy['tokens_per_s']:.2f}; ngram-async / async: steps "
              f"x{na['steps'] / asy['steps']:.2f}, calls x{na['calls'] / asy['calls']:.2f}, "
              f"tokens/s "
              f"x{na['tokens_per_s'] / asy['tokens_per_s']:.2f}; ngram-async / ngram tokens/s "
              f"x{na['tokens_per_s'] / ng['tokens_per_s']:.2f}; acceptance "
              f"{ng['accepted'] / max(ng['draft_tokens'], 1):.1%} (sync), "
              f"{na['accepted'] / max(na['draft_tokens'], 1):.1%} (async); greedy outputs "
              f"{'identical' if same else 'DIFFER'}")
        results[name] = {e: {k: v for k, v in r.items() if k != "outputs"}
                         for e, r in res.items()} | {"identical": same}
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
