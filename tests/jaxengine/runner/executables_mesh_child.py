"""Child process of test_executables.py on 2 virtual CPU devices: executables saved whole on a
tp=2 mesh and loaded whole by a second engine.

    python executables_mesh_child.py CACHE_DIR

A tp=2 engine over the tiny Llama fixture precompiles into CACHE_DIR (empty) and samples a
seeded workload; then a second engine (a model object of its own, so no program of the
first's in memory) precompiles over the same directory and samples it again. Prints one JSON
line: per engine its programs (steps and samplers), those compiled and those loaded whole,
its outputs and its compilations after warm-up; the files saved; and whether loading a saved
step onto one of the two devices was refused, and the warning that said so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import build_engine
from jaxengine.runner import executables
from jaxengine.runner.compiles import cache_hit_count, compile_count
from jaxengine.runner.programs import SAMPLE_NAME, STEP_NAME
from scheduler import SamplingParams

MODEL = Path(__file__).resolve().parents[2] / "fixtures" / "tiny" / "llama3_gqa"
PROMPTS = [[5, 6, 7], [9] * 6, [3, 1, 4, 1, 5]]
PARAMS = SamplingParams(max_tokens=3, temperature=1.0, seed=7, logprobs=2, ignore_eos=True)


def engine_run(cache_dir: str) -> dict[str, Any]:
    """Build, precompile and sample `PROMPTS` with a tp=2 engine over `cache_dir`."""
    engine = build_engine(EngineArgs(
        model=str(MODEL), skip_tokenizer_init=True, tensor_parallel_size=2, max_model_len=32,
        max_num_seqs=2, max_num_batched_tokens=2, num_gpu_blocks_override=24, block_size=4,
        compilation_cache_dir=cache_dir))
    runner = engine.runner
    compiled, loaded = compile_count(STEP_NAME, SAMPLE_NAME), cache_hit_count(STEP_NAME,
                                                                               SAMPLE_NAME)
    runner.precompile(progress=False)
    compiled = compile_count(STEP_NAME, SAMPLE_NAME) - compiled
    loaded = cache_hit_count(STEP_NAME, SAMPLE_NAME) - loaded
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, PARAMS)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                outputs[out.request_id] = [list(c.token_ids),
                                           [{t: lp.logprob for t, lp in step.items()}
                                            for step in c.logprobs]]
    return {"programs": len(runner.token_buckets) + len(runner.request_buckets),
            "compiled": compiled, "loaded": loaded, "outputs": outputs,
            "after_warmup": runner.stats.compilations_after_warmup}


def main(cache_dir: str) -> None:
    """Run both engines, try the refused load, print the JSON line."""
    cold = engine_run(cache_dir)
    saved = sorted((Path(cache_dir) / executables.SUBDIR).iterdir())
    warm = engine_run(cache_dir)
    step = next(p for p in saved if p.name.startswith(STEP_NAME))
    key = step.name.removeprefix(f"{STEP_NAME}-").removesuffix(".exe")
    with _warnings() as logged:
        refused = executables.load(cache_dir, STEP_NAME, key, jax.devices()[1:2]) is None
    print(json.dumps({"cold": cold, "warm": warm, "saved": [p.name for p in saved],
                      "refused": refused, "logged": logged}))


@contextlib.contextmanager
def _warnings() -> Iterator[list[str]]:
    """The runner's warnings logged meanwhile."""
    logged: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("jaxengine.runner")
    logger.addHandler(handler)
    try:
        yield logged
    finally:
        logger.removeHandler(handler)


if __name__ == "__main__":
    main(*sys.argv[1:])
