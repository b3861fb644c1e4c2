"""`LLM()` built again and again in one process (a notebook re-running its cell) keeps nothing
of the engines it dropped: not their weights, not their KV cache, not their compiled programs
(jaxengine/runner/programs.py binds a model's functions into its jitted step and sampler, and
jaxengine/fixed_batch/programs.py into `generate`'s and `score`'s, so JAX's caches let them go
with the model)."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import jax
import pytest

from jaxengine import LLM, SamplingParams, encode_batch, generate, model_fns_of, score
from jaxengine.fixed_batch import programs as fixed_batch_programs
from jaxengine.runner import programs

TINY = Path(__file__).parents[1] / "fixtures" / "tiny" / "llama3_gqa"
GREEDY = SamplingParams(max_tokens=3, temperature=0.0)


def _generate_once() -> tuple[weakref.ref, ...]:
    """An LLM used as a researcher does (its engine, then `generate` and `score` over
    `model_fns_of`), dropped; weak references to what must go with it."""
    llm = LLM(str(TINY), precompile=False, max_num_seqs=4, max_num_batched_tokens=64)
    llm.generate(["Hello there"], GREEDY, use_tqdm=False)
    fns, tokenizer = model_fns_of(llm)
    ids, lens = encode_batch(tokenizer, ["Hello there"])
    out = generate(fns, ids, lens, max_new_tokens=2)
    score(fns, ids, out.tokens, lens, out.lengths).total.block_until_ready()
    step = programs.programs_for(fns).step
    return (weakref.ref(llm.llm_engine), weakref.ref(fns), weakref.ref(step),
            weakref.ref(fns.step))


def _large_arrays() -> set[int]:
    """Ids of the process's live device arrays big enough to be weights or a KV pool (other
    tests of this worker may hold theirs)."""
    return {id(a) for a in jax.live_arrays() if a.size > 1000}


def test_a_dropped_llm_leaves_no_engine_weights_or_programs_behind() -> None:
    gc.collect()
    programs_before, arrays_before = set(programs._programs), _large_arrays()
    fixed_batch_before = set(fixed_batch_programs._programs)
    for _ in range(2):
        engine, model, step, step_fn = _generate_once()
        gc.collect()
        assert engine() is None and model() is None
        assert step() is None  # the jitted step, and the executables its caches held
        assert set(programs._programs) == programs_before
        # generate's and score's programs held the model's functions, and their executables
        assert step_fn() is None
        assert set(fixed_batch_programs._programs) == fixed_batch_before
        assert _large_arrays() <= arrays_before  # its weights and KV pool are gone


@pytest.mark.slow
def test_default_llms_built_again_and_again_stop_growing() -> None:
    """The embedded SmolLM2 built four times in one process, each used through `LLM.generate`
    and through `generate` and `score` over `model_fns_of`: resident memory (returned to the
    system with malloc_trim, so that what is measured is what is still referenced) grows by
    less than 50 MB from the second build to the fourth. Programs jitted once for the process,
    with each model's functions as static arguments, held every engine's model functions and
    executables: about 700 MB an engine."""
    script = textwrap.dedent("""
        import ctypes, gc, os
        import jaxengine
        from jaxengine import LLM, SamplingParams
        def rss():
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        for _ in range(4):
            llm = LLM(precompile=False)
            llm.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0.0),
                         use_tqdm=False)
            fns, tok = jaxengine.model_fns_of(llm)
            ids, lens = jaxengine.encode_batch(tok, ["Hello", "The capital of France is"])
            out = jaxengine.generate(fns, ids, lens, max_new_tokens=4)
            jaxengine.score(fns, ids, out.tokens, lens, out.lengths).total.block_until_ready()
            del llm, fns, out
            gc.collect()
            print(rss() // 2**20, flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=900, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    sizes = list(map(int, done.stdout.split()))
    assert sizes[3] - sizes[1] < 50, sizes
