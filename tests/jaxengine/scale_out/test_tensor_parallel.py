"""Tensor parallelism (issue 12): the layout rules here; the mesh checks on 8 virtual CPU
devices in a child process (`tensor_parallel_checks.py` via `tests/parallel_helpers.py`)."""

from __future__ import annotations

import json

import pytest

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import build_engine
from jaxengine.model.config import ModelConfig
from jaxengine.model.tensor_parallel import TPLayout, tp_layout, valid_tp_sizes
from tests.parallel_helpers import run_pytest, run_python

CHECKS = "tests/jaxengine/scale_out/tensor_parallel_checks.py"

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


DEVICE_CHECK = """
from benchmarks.device_sections.context import Context
from benchmarks.device_sections.model import tensor_parallel
ctx = Context(impls=(), interpret=True, smoke=True, quick=True, peak_gbps=4800.0, iters=1)
assert tensor_parallel(ctx) == []
"""


@pytest.mark.slow  # 27 s: a device tool's smoke on CPU (the CPU smoke of every section is slow too)
def test_device_checks_tensor_parallel_section_skips_what_the_devices_cannot_hold() -> None:
    """benchmarks/device_check.py's section in its smoke sizes on 2 devices: tp=1 and 2 timed
    against the roofline, 4 and 8 skipped."""
    lines = [line for line in run_python(DEVICE_CHECK, num_devices=2).splitlines()
             if line.startswith("[tensor-parallel]")]
    assert len(lines) == 4
    for tp, line in zip((1, 2), lines, strict=False):
        assert line.startswith(f"[tensor-parallel] tp={tp}: decode step ")
        assert "% of 4800 GB/s" in line and "equal to tp=1's: 4/4" in line
    assert lines[2:] == [f"[tensor-parallel] tp={tp}: skipped (2 device(s))" for tp in (4, 8)]


def test_tensor_parallel_size_is_validated() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineArgs(tensor_parallel_size=0)


def test_an_engine_lives_on_the_devices_it_is_given() -> None:
    """`build_engine(args, devices=[d])`: weights and KV cache on d, and they stay there."""
    out = run_python(PLACEMENT, num_devices=4, timeout=120)
    assert len(json.loads(out.strip().splitlines()[-1])) == 4


def test_layout_splits_kv_heads_or_repeats_them_and_pads_the_vocabulary() -> None:
    cfg = ModelConfig.tiny(num_heads=8, num_kv_heads=2, vocab_size=100)
    assert tp_layout(cfg, 1) == TPLayout(tp=1, num_kv_heads=2, kv_repeat=1, vocab_size=100)
    assert tp_layout(cfg, 2) == TPLayout(tp=2, num_kv_heads=2, kv_repeat=1, vocab_size=100)
    # tp > K: every device holds one KV head, the one its query heads read
    assert tp_layout(cfg, 8) == TPLayout(tp=8, num_kv_heads=8, kv_repeat=4, vocab_size=104)
    assert tp_layout(cfg, 8).kv_heads_per_device == 1
    assert valid_tp_sizes(cfg, up_to=16) == [1, 2, 4, 8]


@pytest.mark.parametrize(("overrides", "tp", "message"), [
    (dict(num_heads=8, num_kv_heads=2), 3, r"tensor_parallel_size=3 does not divide the "
     r"model's num_heads=8; this model takes tensor_parallel_size 1, 2, 4, 8"),
    (dict(num_heads=12, num_kv_heads=6, intermediate_size=48), 4,
     r"tensor_parallel_size=4 and the model's num_kv_heads=6: one must divide the other"),
    (dict(num_heads=8, num_kv_heads=8, intermediate_size=36), 8,
     r"does not divide the model's intermediate_size=36"),
])
def test_shapes_that_cannot_be_split_are_refused(overrides: dict, tp: int, message: str
                                                 ) -> None:
    with pytest.raises(ValueError, match=message):
        tp_layout(ModelConfig.tiny(**overrides), tp)


def test_more_devices_than_exist_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=64 needs 64 devices, but jax "
                                         r"sees \d+ .*xla_force_host_platform_device_count"):
        build_engine(EngineArgs(tensor_parallel_size=64))


def test_tensor_parallel_on_eight_devices() -> None:
    """tp = 1, 2, 4, 8 give one device's tokens and logprobs (GQA with K < tp, tied and
    untied embeddings, padded vocabulary); weights and cache really split; preemption,
    prefix caching and chunked prefill; zero compilations after warm-up; donation in place;
    jit generate. See tensor_parallel_checks.py."""
    out = run_pytest([CHECKS], num_devices=8, timeout=400)
    assert " passed" in out and "failed" not in out


@pytest.mark.slow
def test_tensor_parallel_on_eight_devices_slow() -> None:
    """The slow checks: more tp sizes and checkpoints, scanned layers, the Pallas kernels
    under shard_map (interpret mode), the default SmolLM2 model at tp=3."""
    out = run_pytest([CHECKS], num_devices=8, timeout=900, args=["-m", "slow"])
    assert " passed" in out and "failed" not in out
