"""Host offloading over a tiny random Llama checkpoint: the [Ly, P, L, 2K, H] pool's pages go to
the host and back unchanged (greedy outputs equal those without offloading), precompiled with
`debug_recompiles` (nothing compiles after warm-up), in every KV cache dtype (the pages come
back bit for bit), and on a tensor-parallel mesh whose pool is split over the heads (2 virtual
CPU devices, in a child process)."""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import build_engine
from jaxengine.kv_offload import BlockCopier
from scheduler import SamplingParams, check_invariants
from tests.parallel_helpers import run_python

TINY = "tests/fixtures/tiny/llama3_gqa"
SHARED = list(range(1, 33))
PROMPTS = [SHARED + [40, 41], [(7 + j) % 120 + 1 for j in range(60)],
           [(14 + j) % 120 + 1 for j in range(60)], SHARED + [50, 51], SHARED + [60]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def generate(**kw: Any) -> tuple[list[list[int]], dict[str, Any]]:
    """The workload's greedy tokens and what the engine counted, on a 23-block pool."""
    args = dict(model=TINY, skip_tokenizer_init=True, block_size=4, num_gpu_blocks_override=24,
                max_model_len=80, max_num_batched_tokens=32, max_num_seqs=1, precompile=True,
                debug_recompiles=True)
    engine = build_engine(EngineArgs(**{**args, **kw}))
    pointers = [s.data.unsafe_buffer_pointer() for s in engine.runner.kv.addressable_shards]
    sharding = engine.runner.kv.sharding
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        check_invariants(engine.state)
    engine.step()
    assert engine.state.num_free_blocks == 23
    # The copies keep the pool's layout and its buffers.
    assert engine.runner.kv.sharding.is_equivalent_to(sharding, engine.runner.kv.ndim)
    assert [s.data.unsafe_buffer_pointer()
            for s in engine.runner.kv.addressable_shards] == pointers
    c = engine.state.counters
    return [done[f"r{i}"] for i in range(len(PROMPTS))], dict(
        hits=c.prefix_cache_hits, host=c.connector_prefix_cache_hits,
        computed=engine.runner.stats.computed_tokens,
        after_warmup=engine.runner.stats.compilations_after_warmup)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_outputs_are_unchanged_by_offloading(async_scheduling: bool) -> None:
    plain, p = generate(async_scheduling=async_scheduling)
    offloaded, o = generate(async_scheduling=async_scheduling, kv_offloading_size=0.001)
    assert offloaded == plain
    assert p["host"] == 0 and o["host"] >= len(SHARED)
    assert o["hits"] + o["host"] == 2 * len(SHARED) > p["hits"]
    # Every token is computed or taken from one cache or the other, and fewer are computed.
    assert p["computed"] + p["hits"] == o["computed"] + o["hits"] + o["host"]
    assert o["computed"] < p["computed"]
    assert o["after_warmup"] == p["after_warmup"] == 0


def test_an_fp8_pool_is_offloaded_with_the_same_outputs() -> None:
    # Compiled as steps need them: the copies are what this checks (the bits, below).
    kw = dict(kv_cache_dtype="fp8", attention_backend="reference", precompile=False,
              debug_recompiles=False)
    plain, _ = generate(**kw)
    offloaded, o = generate(kv_offloading_size=0.001, **kw)
    assert offloaded == plain
    assert o["host"] >= len(SHARED)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_pages_come_back_bit_for_bit_in_every_dtype(dtype: str) -> None:
    values = jax.random.normal(jax.random.key(0), (2, 8, 4, 4, 8)) * 100  # fp8 saturates
    kv = values.astype(dtype)
    copier = BlockCopier(kv, page_axis=1)
    assert copier.page_bytes == 2 * 4 * 4 * 8 * jnp.dtype(dtype).itemsize
    ids = np.array([5, 2, 7], np.int32)
    pages = np.asarray(copier.gather(kv, ids))[:len(ids)]  # on the host, [3, 2, 4, 4, 8]
    assert pages.dtype == jnp.dtype(dtype)
    back = copier.scatter(jnp.zeros_like(kv), np.array([1, 3, 4], np.int32), pages)
    assert back.dtype == kv.dtype
    bits = jnp.uint16 if jnp.dtype(dtype).itemsize == 2 else jnp.uint8
    np.testing.assert_array_equal(jax.lax.bitcast_convert_type(back[:, [1, 3, 4]], bits),
                                  jax.lax.bitcast_convert_type(kv[:, [5, 2, 7]], bits))


TENSOR_PARALLEL = """
import json
from tests.jaxengine.kv_offload.test_real_model import generate
plain, p = generate(tensor_parallel_size=2)
offloaded, o = generate(tensor_parallel_size=2, kv_offloading_size=0.001)
print(json.dumps(dict(same=offloaded == plain, plain=p, offloaded=o)))
"""


def test_a_pool_split_over_the_heads_is_copied_whole() -> None:
    result = json.loads(run_python(TENSOR_PARALLEL, num_devices=2, timeout=300).splitlines()[-1])
    assert result["same"]
    o = result["offloaded"]
    assert o["host"] >= len(SHARED) and o["after_warmup"] == 0
    p = result["plain"]
    assert p["computed"] + p["hits"] == o["computed"] + o["hits"] + o["host"]
