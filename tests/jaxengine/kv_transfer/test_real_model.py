"""P/D disaggregation over a tiny random Llama checkpoint: the [Ly, P, L, 2K, H] pool's pages
move between two engines unchanged (greedy outputs equal the consumer's own, computed again
after its prefix cache is emptied), precompiled with `debug_recompiles` (no transfer compiles
anything after warm-up), also with both pools split over the heads on a
tensor-parallel mesh (2 virtual CPU devices, in a child process); over TCP and device to device
(`jax.experimental.transfer`)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import build_engine
from scheduler import reset_prefix_cache
from tests.jaxengine.kv_transfer.test_disaggregation import decode, prefill
from tests.parallel_helpers import run_python

TINY = "tests/fixtures/tiny/llama3_gqa"
PROMPTS = [list(range(1, 42)), [(7 + j) % 120 + 1 for j in range(23)], [5, 6, 7]]


def disaggregated(transport: str = "tcp", **kw: Any) -> dict[str, Any]:
    """The prompts prefilled by one engine and decoded by another, then by that other alone."""
    args = dict(model=TINY, skip_tokenizer_init=True, block_size=4, num_gpu_blocks_override=64,
                max_model_len=80, max_num_batched_tokens=32, max_num_seqs=4,
                precompile=True, debug_recompiles=True, **kw)
    extra = {"transport": transport}
    producer = build_engine(EngineArgs(**args, kv_transfer_config={
        "kv_role": "kv_producer", "kv_port": 0, "kv_connector_extra_config": extra}))
    consumer = build_engine(EngineArgs(**args, kv_transfer_config={
        "kv_role": "kv_consumer", "kv_connector_extra_config": extra}))
    sharding = consumer.runner.kv.sharding
    done = decode(consumer, producer, PROMPTS, prefill(producer, PROMPTS))
    consumer.state = reset_prefix_cache(consumer.state)  # nothing loaded is reused below
    alone = decode(consumer, producer, PROMPTS, {})
    tokens = {name: [list(d[f"r{i}"].outputs[0].token_ids) for i in range(len(PROMPTS))]
              for name, d in (("loaded", done), ("alone", alone))}
    return dict(tokens, cached=[done[f"r{i}"].num_cached_tokens for i in range(len(PROMPTS))],
                after_warmup=[e.runner.stats.compilations_after_warmup
                              for e in (producer, consumer)],
                same_sharding=consumer.runner.kv.sharding.is_equivalent_to(
                    sharding, consumer.runner.kv.ndim))


@pytest.mark.slow  # two tiny-model engines compiling their buckets
@pytest.mark.parametrize("transport", ["tcp", "jax"])
def test_a_real_pool_moves_unchanged(transport: str) -> None:
    result = disaggregated(transport)
    assert result["loaded"] == result["alone"]
    assert result["cached"] == [len(p) - 1 for p in PROMPTS]
    assert result["same_sharding"] and result["after_warmup"] == [0, 0]


TENSOR_PARALLEL = """
import json
from tests.jaxengine.kv_transfer.test_real_model import disaggregated
print(json.dumps(disaggregated({transport!r}, tensor_parallel_size=2)))
"""


@pytest.mark.slow  # a child process, two engines on 2 virtual devices
@pytest.mark.parametrize("transport", ["tcp", "jax"])
def test_pools_split_over_the_heads_exchange_whole_pages(transport: str) -> None:
    result = json.loads(run_python(TENSOR_PARALLEL.format(transport=transport), num_devices=2,
                                   timeout=300).splitlines()[-1])
    assert result["loaded"] == result["alone"]
    assert result["cached"] == [len(p) - 1 for p in PROMPTS]
    assert result["same_sharding"] and result["after_warmup"] == [0, 0]
