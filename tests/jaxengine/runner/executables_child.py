"""Child process of test_executables.py: a runner over the fake model, its compilation cache at
a given directory, precompiled, on a small sampled workload.

    python executables_child.py CACHE_DIR

prints one JSON line: each request's tokens and logprobs, how often the step and the sampler
were traced (JAX's trace events), the programs precompile made and of those loaded whole, and
whether the first step and sampler donated the KV pool and the output counts.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any

import jax

from jaxengine.model.fake import fake_model
from jaxengine.runner.compilation_cache import configure
from jaxengine.runner.compiles import cache_hit_count
from jaxengine.runner.config import RunnerConfig
from jaxengine.runner.penalty_inputs import WRITE_SLOT_NAME
from jaxengine.runner.programs import SAMPLE_NAME, STEP_NAME
from jaxengine.runner.runner import Runner
from jaxengine.sampling.rows import SamplingRow
from jaxengine.sampling_params import SamplingParams
from scheduler import (
    Request,
    SchedulerConfig,
    add_request,
    init_state,
    schedule,
    update_from_output,
)

VOCAB = 83  # a vocabulary no other test's fake model has: programs of their own
# Token buckets 1 and 2, one request bucket: few programs, so a cold start is short.
CONFIG = RunnerConfig(max_num_batched_tokens=2, max_num_seqs=2, max_model_len=32, block_size=4,
                      num_blocks=24, max_logprobs=3, intermediate_token_buckets=False,
                      debug_recompiles=True, num_speculative_tokens=0)
PROMPTS = [[5, 6, 7], [9] * 6, [3, 1, 4, 1, 5]]
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
traces: Counter[str] = Counter()


def _count_traces(event: str, duration_secs: float, **kwargs: Any) -> None:
    del duration_secs
    if event == TRACE_EVENT:
        traces[str(kwargs.get("fun_name"))] += 1


def run(runner: Runner, max_tokens: int = 4) -> dict[str, list]:
    """Sample `PROMPTS` (temperature 1, seeded, two logprobs): {request: [tokens, logprobs]}."""
    c = runner.config
    state = init_state(SchedulerConfig(
        max_num_batched_tokens=c.max_num_batched_tokens, max_num_seqs=c.max_num_seqs,
        max_model_len=c.max_model_len, block_size=c.block_size, num_blocks=c.num_blocks))
    sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, logprobs=2)
    for i, p in enumerate(PROMPTS):
        state = add_request(state, Request(request_id=f"r{i}", prompt_token_ids=tuple(p),
                                           sampling_params=sp))
    out: dict[str, list] = {f"r{i}": [[], []] for i in range(len(PROMPTS))}
    while state.requests:
        state, plan = schedule(state)
        rows = {r: SamplingRow(params=sp, seed=7, position=len(out[r][0]))
                for r in plan.sampling_req_ids}
        sampled = runner.execute(plan, rows)
        state, _ = update_from_output(state, plan, {r: [t.token_id] for r, t in
                                                    sampled.items()})
        for r, t in sampled.items():
            out[r][0].append(t.token_id)
            out[r][1].append(t.logprob)
    return out


def main(cache_dir: str) -> None:
    """Precompile, run the workload, print the JSON line."""
    configure(cache_dir)
    jax.monitoring.register_event_duration_secs_listener(_count_traces)
    runner = Runner(fake_model(VOCAB), CONFIG)
    runner.precompile(progress=False)
    kv, counts = runner.kv, runner.penalties.tables.output_counts  # the two donated inputs
    outputs = run(runner)
    print(json.dumps({
        "outputs": outputs,
        "traces": sum(n for name, n in traces.items()
                      if any(p in name for p in (STEP_NAME, SAMPLE_NAME, WRITE_SLOT_NAME))),
        "made": runner.stats.compilations,
        "loaded": cache_hit_count(STEP_NAME, SAMPLE_NAME, WRITE_SLOT_NAME),
        "programs": len(runner.token_buckets) + len(runner.request_buckets) + 1,  # + the writer
        "donated": kv.is_deleted() and counts.is_deleted(),
        "after_warmup": runner.stats.compilations_after_warmup,
    }))


if __name__ == "__main__":
    main(*sys.argv[1:])
