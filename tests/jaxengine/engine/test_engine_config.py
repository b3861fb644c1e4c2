"""`create_engine_config`: every default decided once, from the arguments and the model's and
devices' facts, into one frozen config."""

from __future__ import annotations

import dataclasses

import pytest

from jaxengine.config import EngineConfig
from jaxengine.engine.args import EngineArgs
from jaxengine.engine.engine_config import create_engine_config
from jaxengine.runner.buckets import pick_bucket
from jaxengine.runner.compiles import DEBUG_ENV
from jaxengine.runner.config import RunnerConfig
from scheduler import add_request, check_invariants, schedule, update_from_output
from tests.scheduler.util import req, state_with

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


NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def test_the_scheduled_budget_defaults_to_the_runners_with_or_without_drafts() -> None:
    draft_model = {"method": "draft_model", "model": "draft.gguf", "num_speculative_tokens": 3}
    for spec in (None, NGRAM, draft_model):  # vLLM 0.33 subtracts no draft room either
        s = resolve(max_num_batched_tokens=512, speculative_config=spec).scheduler
        assert (s.max_num_batched_tokens, s.max_num_scheduled_tokens) == (512, 512)
    s = resolve(max_num_batched_tokens=512, max_num_scheduled_tokens=384).scheduler
    assert (s.max_num_batched_tokens, s.max_num_scheduled_tokens) == (512, 384)


def test_a_scheduled_budget_that_does_not_fit_is_refused_saying_what_to_change() -> None:
    with pytest.raises(ValueError, match="max_num_scheduled_tokens must be an integer >= 1, "
                                         "got 0"):
        EngineArgs(max_num_scheduled_tokens=0)
    with pytest.raises(ValueError, match=r"max_num_scheduled_tokens=600 must be in \[1, "
                                         r"max_num_batched_tokens=512\]; .* lower "
                                         r"max_num_scheduled_tokens .* or raise "
                                         r"max_num_batched_tokens"):
        resolve(max_num_batched_tokens=512, max_num_scheduled_tokens=600)
    with pytest.raises(ValueError, match="max_num_scheduled_tokens=512 is smaller than "
                                         "max_model_len=1024 while chunked prefill is off"):
        resolve(enable_chunked_prefill=False, max_num_scheduled_tokens=512)
    # A draft model's 3 lookahead slots need a runner of at least 4 tokens (vLLM's rule)
    draft_model = {"method": "draft_model", "model": "draft.gguf", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="max_num_batched_tokens=3 leaves no room for a token "
                                         "beside the 3 lookahead slots of speculative_config "
                                         "method 'draft_model' .* Raise max_num_batched_tokens "
                                         "above 3 or lower num_speculative_tokens"):
        resolve(max_num_batched_tokens=3, max_num_seqs=1, speculative_config=draft_model)
    assert resolve(max_num_batched_tokens=4, max_num_seqs=1,
                   speculative_config=draft_model).scheduler.max_num_scheduled_tokens == 4
    # n-gram drafts write no KV ahead: one token of budget is room enough
    assert resolve(max_num_batched_tokens=1, max_num_seqs=1,
                   speculative_config=NGRAM).scheduler.max_num_scheduled_tokens == 1


def _step_with_drafts(**budget: int):
    """docs/SCHEDULING.md §2's worked example up to its step 1: (config, step 1's plan)."""
    config = resolve(max_num_batched_tokens=16, max_num_seqs=4, async_scheduling=False,
                     speculative_config=NGRAM, **budget)
    s = state_with(config.scheduler, req("A", 3), req("B", 3))
    s, out = schedule(s)
    assert dict(out.num_scheduled_tokens) == {"A": 3, "B": 3}
    s, _ = update_from_output(s, out, {"A": [7], "B": [7]},
                              draft_token_ids={"A": [8, 9, 10], "B": [11, 12, 13]})
    s = add_request(s, req("C", 12))
    s, out = schedule(s)
    check_invariants(s, out)
    return config, out


def test_a_step_schedules_exactly_the_smaller_budget_and_the_runners_bucket_holds_the_drafts(
        ) -> None:
    """docs/SCHEDULING.md §2, "Two token budgets": the worked example."""
    config, out = _step_with_drafts(max_num_scheduled_tokens=10)
    token_buckets, request_buckets = RunnerConfig.of(config).buckets()
    assert (token_buckets, request_buckets) == ((1, 2, 4, 8, 16), (8, 16))
    assert dict(out.num_scheduled_tokens) == {"A": 4, "B": 4, "C": 2}
    assert out.total_num_scheduled_tokens == 10 == config.scheduler.max_num_scheduled_tokens
    assert dict(out.scheduled_spec_decode_tokens) == {"A": (8, 9, 10), "B": (11, 12, 13)}
    assert out.input_token_ids["A"] == (7, 8, 9, 10)
    assert pick_bucket(token_buckets, out.total_num_scheduled_tokens) == 16
    rows = sum(1 + len(out.scheduled_spec_decode_tokens.get(r, ()))
               for r in out.sampling_req_ids)
    assert (set(out.sampling_req_ids), rows) == ({"A", "B"}, 8)  # C is mid-prompt
    assert pick_bucket(request_buckets, rows) == 8
    # Not given, the scheduler hands out the runner's 16: C gets 8
    _, out = _step_with_drafts()
    assert dict(out.num_scheduled_tokens) == {"A": 4, "B": 4, "C": 8}


def test_lora_settings_resolve_as_vllms_and_are_checked_as_given() -> None:
    assert resolve().lora is None and resolve().scheduler.max_loras is None
    config = resolve(enable_lora=True, max_loras=2, max_lora_rank=8)
    assert (config.lora.max_loras, config.lora.max_lora_rank) == (2, 8)
    assert config.lora.max_cpu_loras == 2  # None: max_loras
    assert config.scheduler.max_loras == 2  # the per-step adapter limit (SCHEDULING.md §14)
    runner = RunnerConfig.of(config)
    assert (runner.max_loras, runner.max_lora_rank) == (2, 8)
    assert resolve(enable_lora=True, max_cpu_loras=5).lora.max_cpu_loras == 5
    for kw, message in ((dict(max_lora_rank=12), "max_lora_rank must be one of 1, 8, 16"),
                        (dict(max_loras=3, max_cpu_loras=2), "max_cpu_loras=2 must be >= "
                                                             "max_loras=3"),
                        (dict(max_loras=0), "max_loras must be an integer >= 1, got 0"),
                        (dict(enable_lora="yes"), "enable_lora must be True or False"),
                        (dict(enable_lora=True, batch_invariant=True), "enable_lora")):
        with pytest.raises(ValueError, match=message):
            EngineArgs(**kw)
