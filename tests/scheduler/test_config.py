"""SchedulerConfig: defaults and every validation rule of docs/SCHEDULING.md §2."""

import pytest

from scheduler import SchedulerConfig


def test_defaults_follow_vllm():
    c = SchedulerConfig(num_blocks=10)
    assert (c.max_num_batched_tokens, c.max_num_scheduled_tokens, c.max_num_seqs,
            c.max_model_len) == (2048, 2048, 128, 8192)
    assert c.enable_chunked_prefill and c.enable_prefix_caching and c.reserve_full_prompt
    assert (c.long_prefill_token_threshold, c.max_num_partial_prefills,
            c.max_long_partial_prefills, c.policy, c.block_size, c.watermark) == (
        0, 1, 1, "fcfs", 16, 0.0)


def test_num_blocks_is_required():
    with pytest.raises(TypeError):
        SchedulerConfig()


@pytest.mark.parametrize("kwargs, names", [
    (dict(max_num_batched_tokens=512, max_model_len=1024, enable_chunked_prefill=False),
     ["max_num_batched_tokens=512", "max_model_len=1024"]),
    (dict(max_num_batched_tokens=64, max_num_seqs=128), ["max_num_batched_tokens=64",
                                                         "max_num_seqs=128"]),
    (dict(long_prefill_token_threshold=9000), ["long_prefill_token_threshold=9000"]),
    (dict(max_num_partial_prefills=2, enable_chunked_prefill=False, max_model_len=2048),
     ["max_num_partial_prefills=2"]),
    (dict(max_num_partial_prefills=2, max_long_partial_prefills=3),
     ["max_long_partial_prefills=3", "max_num_partial_prefills=2"]),
    (dict(policy="lifo"), ["'lifo'"]),
    (dict(block_size=0), ["block_size=0"]),
    (dict(num_blocks=0), ["num_blocks=0"]),
    (dict(max_num_seqs=0), ["max_num_seqs=0"]),
    (dict(watermark=1.0), ["watermark=1.0"]),
    (dict(watermark=-0.1), ["watermark=-0.1"]),
    (dict(max_num_scheduled_tokens=4096), ["max_num_scheduled_tokens=4096",
                                           "raise max_num_batched_tokens"]),
    (dict(max_num_scheduled_tokens=0), ["max_num_scheduled_tokens=0", "at least 1"]),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=8192,
          max_num_scheduled_tokens=4096),
     ["max_num_scheduled_tokens=4096", "max_model_len=8192", "chunked prefill is off"]),
])
def test_invalid_values_raise_naming_them(kwargs, names):
    kwargs = {"num_blocks": 10, **kwargs}
    with pytest.raises(ValueError) as e:
        SchedulerConfig(**kwargs)
    for name in names:
        assert name in str(e.value)


def test_budget_beyond_what_sequences_can_use_warns():
    with pytest.warns(UserWarning, match="max_num_batched_tokens=256 exceeds"):
        SchedulerConfig(num_blocks=10, max_num_batched_tokens=256, max_num_seqs=1,
                        max_model_len=128)


def test_partial_prefills_default_the_long_threshold_to_4_percent():
    c = SchedulerConfig(num_blocks=10, max_num_partial_prefills=2, max_model_len=1000)
    assert c.long_prefill_token_threshold == 40
    c = SchedulerConfig(num_blocks=10, max_num_partial_prefills=2, max_model_len=1000,
                        long_prefill_token_threshold=7)
    assert c.long_prefill_token_threshold == 7


def test_frozen_and_replace_revalidates():
    c = SchedulerConfig(num_blocks=10)
    with pytest.raises(AttributeError):
        c.num_blocks = 3
    assert c.replace(num_blocks=3).num_blocks == 3
    with pytest.raises(ValueError, match="block_size=0"):
        c.replace(block_size=0)
