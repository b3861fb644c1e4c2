"""Tensor parallelism (issue 12): the mesh, the engine on a chosen device group.

Mesh checks need several devices, so they run in a child process with virtual CPU devices
(`tests/parallel_helpers.py`).
"""

from __future__ import annotations

import json

import pytest

from jaxengine.engine.args import EngineArgs
from tests.parallel_helpers import run_python

PLACEMENT = """
import json, jax
from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import build_engine
from scheduler import SamplingParams
model = "tests/fixtures/tiny/llama3_gqa"
args = EngineArgs(model=model, skip_tokenizer_init=True, num_gpu_blocks_override=16,
                  max_model_len=64)
device = jax.devices()[3]
engine = build_engine(args, devices=[device])
placed = jax.tree.leaves(engine.runner.model.params) + [engine.runner.kv]
assert all(x.devices() == {device} for x in placed), [x.devices() for x in placed]
engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4))
while engine.has_unfinished_requests():
    outs = engine.step()
assert engine.runner.kv.devices() == {device}
print(json.dumps(list(outs[0].outputs[0].token_ids)))
"""


def test_tensor_parallel_size_is_validated() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineArgs(tensor_parallel_size=0)


def test_an_engine_lives_on_the_devices_it_is_given() -> None:
    """`build_engine(args, devices=[d])`: weights and KV cache on d, and they stay there."""
    out = run_python(PLACEMENT, num_devices=4, timeout=120)
    assert len(json.loads(out.strip().splitlines()[-1])) == 4
