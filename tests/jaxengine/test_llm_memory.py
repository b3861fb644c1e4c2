"""`LLM()` built again and again in one process (a notebook re-running its cell) keeps nothing
of the engines it dropped: not their weights, not their KV cache, not their compiled programs
(jaxengine/runner/programs.py binds a model's functions into its jitted step and sampler, so
JAX's caches let them go with the model)."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import jax
import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.runner import programs

TINY = Path(__file__).parents[1] / "fixtures" / "tiny" / "llama3_gqa"
GREEDY = SamplingParams(max_tokens=3, temperature=0.0)


def _generate_once() -> tuple[weakref.ref, weakref.ref, weakref.ref]:
    llm = LLM(str(TINY), precompile=False, max_num_seqs=4, max_num_batched_tokens=64)
    llm.generate(["Hello there"], GREEDY, use_tqdm=False)
    model = llm.llm_engine.runner.model
    step = programs.programs_for(model).step
    return weakref.ref(llm.llm_engine), weakref.ref(model), weakref.ref(step)


def _large_arrays() -> set[int]:
    """Ids of the process's live device arrays big enough to be weights or a KV pool (other
    tests of this worker may hold theirs)."""
    return {id(a) for a in jax.live_arrays() if a.size > 1000}


def test_a_dropped_llm_leaves_no_engine_weights_or_programs_behind() -> None:
    gc.collect()
    programs_before, arrays_before = set(programs._programs), _large_arrays()
    for _ in range(2):
        engine, model, step = _generate_once()
        gc.collect()
        assert engine() is None and model() is None
        assert step() is None  # the jitted step, and the executables its caches held
        assert set(programs._programs) == programs_before
        assert _large_arrays() <= arrays_before  # its weights and KV pool are gone


@pytest.mark.slow
def test_three_default_llms_in_one_process_keep_the_memory_of_one() -> None:
    """The embedded SmolLM2 built three times in one process: resident memory after the third
    (returned to the system with malloc_trim, so that what is measured is what is still
    referenced) is within 60 MB of the first's. Programs jitted once for the process, with each
    model's functions as static arguments, would hold every engine's executables and grow it by
    50-80 MB an engine."""
    script = textwrap.dedent("""
        import ctypes, gc, os
        from jaxengine import LLM, SamplingParams
        def rss():
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        for _ in range(3):
            llm = LLM(precompile=False)
            llm.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0.0),
                         use_tqdm=False)
            del llm
            gc.collect()
            print(rss() // 2**20, flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    first, _, third = map(int, done.stdout.split())
    assert third - first < 60, (first, third)
