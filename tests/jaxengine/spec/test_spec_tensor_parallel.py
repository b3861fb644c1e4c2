"""Speculation on a tensor-parallel mesh (tp=2, virtual CPU devices, a child process): the
gathered [R(1+K), D] rows and the sampler's larger buckets keep their shardings, so greedy
outputs are those without drafts and nothing compiles after warm-up."""

from __future__ import annotations

import pytest

from tests.parallel_helpers import run_python

SOURCE = """
from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import build_engine
from scheduler import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}

def run(**kw):
    e = build_engine(EngineArgs(model="tests/fixtures/tiny/llama3_gqa", max_model_len=128,
                                max_num_batched_tokens=64, max_num_seqs=4, block_size=4,
                                num_gpu_blocks_override=200, attention_backend="reference",
                                tensor_parallel_size=2, **kw))
    for i, p in enumerate(["abcabcabcabc", "hello hello hello", "xyz"]):
        e.add_request(f"r{i}", p, SamplingParams(max_tokens=30, temperature=0.0,
                                                 ignore_eos=True))
    done = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    return done, e

plain, _ = run()
spec, e = run(speculative_config=NGRAM, precompile=True, debug_recompiles=True)
print("same", plain == spec, "late", e.runner.stats.compilations_after_warmup,
      "devices", len(e.runner.kv.sharding.device_set))
"""


@pytest.mark.slow  # a child process that loads and compiles on 2 virtual devices (~15 s)
def test_ngram_on_two_devices() -> None:
    out = run_python(SOURCE, num_devices=2, timeout=300)
    assert "same True late 0 devices 2" in out, out
