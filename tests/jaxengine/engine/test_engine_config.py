"""`create_engine_config`: every default decided once, from the arguments and the model's and
devices' facts, into one frozen config."""

from __future__ import annotations

import dataclasses

import pytest

from jaxengine.config import EngineConfig
from jaxengine.engine.args import EngineArgs
from jaxengine.engine.engine_config import create_engine_config
from jaxengine.runner.compiles import DEBUG_ENV
from jaxengine.runner.config import RunnerConfig

PER_BLOCK = 1000  # bytes of one KV page of block_size tokens


def resolve(limit: int = 1024, budget: int = 100 * PER_BLOCK, **kw: object) -> EngineConfig:
    return create_engine_config(EngineArgs(block_size=16, **kw), model_max_model_len=limit,
                                kv_bytes_per_block=PER_BLOCK, device_kv_budget_bytes=budget)


def test_auto_and_none_resolve_to_the_models_and_devices_values() -> None:
    config = resolve()
    assert config.dtype == "float32"  # dtype "auto"
    assert config.max_model_len == config.model_max_model_len == 1024
    assert config.scheduler.num_blocks == 100  # the devices' budget, in whole pages
    assert config.scheduler.max_num_batched_tokens == 2048
    assert config.cache.kv_budget_bytes == 100 * PER_BLOCK
    assert (config.speculative, config.cache.kv_offloading_bytes) == (None, None)
    assert resolve(dtype="bfloat16").dtype == "bfloat16"


def test_the_token_budget_follows_chunking_and_max_num_seqs() -> None:
    assert resolve(max_num_seqs=4096, max_num_batched_tokens=None,
                   num_gpu_blocks_override=100).scheduler.max_num_batched_tokens == 4096
    unchunked = resolve(limit=4096, budget=300 * PER_BLOCK, enable_chunked_prefill=False)
    assert unchunked.scheduler.max_num_batched_tokens == 4096  # a whole prompt per step
    assert resolve(max_num_batched_tokens=512).scheduler.max_num_batched_tokens == 512


def test_explicit_settings_win_over_the_devices() -> None:
    assert resolve(kv_cache_memory_bytes=70 * PER_BLOCK + 999).scheduler.num_blocks == 70
    assert resolve(num_gpu_blocks_override=5000).scheduler.num_blocks == 5000
    assert resolve(max_model_len=512).max_model_len == 512
    assert resolve(kv_offloading_size=0.5).cache.kv_offloading_bytes == 1 << 29


def test_what_cannot_start_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="max_model_len=2048 exceeds the model's limit of 1024"):
        resolve(max_model_len=2048)
    # 1024 tokens in pages of 16: 64 pages plus the null block
    with pytest.raises(ValueError, match="num_gpu_blocks_override=20 .* at least 65"):
        resolve(num_gpu_blocks_override=20)
    with pytest.raises(ValueError, match=r"holds 64 blocks .* needs 65 blocks"):
        resolve(budget=64 * PER_BLOCK)
    with pytest.raises(ValueError, match="max_num_batched_tokens=8 must be >= max_num_seqs=16"):
        resolve(max_num_batched_tokens=8, max_num_seqs=16)


def test_the_runner_reads_its_part(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    config = resolve(max_logprobs=5, speculative_config={"method": "ngram",
                                                         "num_speculative_tokens": 3})
    runner = RunnerConfig.of(config)
    assert (runner.max_num_seqs, runner.block_size, runner.num_blocks) == (128, 16, 100)
    assert (runner.max_logprobs, runner.num_speculative_tokens) == (5, 3)
    assert not runner.debug_recompiles
    monkeypatch.setenv(DEBUG_ENV, "1")  # the environment turns it on as the argument does
    assert resolve().debug_recompiles


def test_the_config_is_frozen() -> None:
    config = resolve()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.dtype = "bfloat16"  # type: ignore[misc]
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16"):
        dataclasses.replace(config, dtype="auto")
