"""benchmarks/throughput.py: the useful FLOPs behind its roofline share (benchmarks/roofline.py),
its flags, its step timing and the CPU kernels it names."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from jaxengine.model.config import ModelConfig

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    """A script of benchmarks/ as a module; its folder on sys.path, as when it runs there."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _script():
    return _load("throughput")


def test_useful_flops_counts_weights_head_and_attention_by_hand() -> None:
    cfg = ModelConfig.tiny(vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=2,
                           num_heads=2, num_kv_heads=1, head_dim=2)
    # prompt of 3, 2 outputs: 4 tokens through the layers (positions 0..3), 2 LM-head rows.
    flops = _load("roofline").useful_flops(cfg, [{"prompt_token_ids": [1, 2, 3],
                                                   "max_tokens": 2}])
    weights = 4 * (2 + 2) * 2 + 2 * 2 * 4 + 3 * 4 * 6  # q,k,v + o + gate, up, down = 120
    assert flops["matmul"] == 2 * weights * 2 * 4
    assert flops["head"] == 2 * 4 * 10 * 2
    assert flops["attention"] == 4 * 2 * 2 * 2 * (1 + 2 + 3 + 4)
    assert flops["total"] == pytest.approx(flops["matmul"] + flops["head"] + flops["attention"])


def test_limits_and_bucket_flags_are_parsed() -> None:
    script = _script()
    args = script.parse_args(["--limits", "16,0", "--baseline-buckets", "16,32"])
    assert script.parse_limits(args.limits) == [16, None]
    assert args.baseline_buckets == (16, 32)
    with pytest.raises(SystemExit):
        script.parse_args(["--token-buckets", "16,x"])


@pytest.mark.slow  # 21 s: a benchmark flag; the FLOP count and parsing tests stay
def test_step_times_account_for_every_scheduled_token_by_bucket() -> None:
    script = _script()
    args = script.parse_args(["--step-times", "--token-buckets", "4,8,16,64"])
    fns, cfg = script.tiny_model(vocab_size=64)
    requests = [{"id": f"r{i}", "prompt_token_ids": list(range(1, 2 + 5 * i)), "max_tokens": 3 + i}
                for i in range(3)]  # prompts of 1, 6, 11 tokens
    steps = script.step_times(args, (fns, cfg, None), requests)
    # Each prompt token and every output but the last goes through the model exactly once.
    assert sum(n for runs in steps.values() for _, n in runs) == sum(
        len(r["prompt_token_ids"]) + r["max_tokens"] - 1 for r in requests)
    assert set(steps) <= {4, 8, 16, 64}
    for bucket, runs in steps.items():
        assert all(t > 0 and 0 < n <= bucket for t, n in runs)
    assert len(steps[4]) >= 3  # the last request's lone decodes


def test_the_report_names_the_cpu_kernels_path_and_the_cpu() -> None:
    from jaxengine_kernels.cpu import native

    line = _script().cpu_kernels()
    pairs = ", int8 in bfloat16 pairs" if native.int8_pairs() else ""
    assert line.startswith(f"{native.isa()} ({native.vector_lanes()}-float vectors{pairs}), ")
    assert line.split("), ", 1)[1]  # the CPU's model name
