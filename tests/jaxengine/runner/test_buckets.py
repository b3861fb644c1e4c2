"""Token and request buckets: the default set starts at 1 token (docs/BENCHMARKS.md §3)."""

from __future__ import annotations

import pytest

from jaxengine.runner.buckets import pick_bucket, token_buckets


def test_default_token_buckets_start_at_one_token() -> None:
    assert token_buckets(2048) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    assert token_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert token_buckets(1) == (1,)


def test_smallest_and_intermediate_buckets() -> None:
    assert token_buckets(100, smallest=16) == (16, 32, 64, 100)
    assert token_buckets(8, smallest=16) == (8,)
    assert token_buckets(100, smallest=16, intermediate=True) == (16, 24, 32, 48, 64, 96, 100)
    assert token_buckets(16, intermediate=True) == (1, 2, 3, 4, 6, 8, 12, 16)


def test_one_token_steps_get_the_one_token_bucket() -> None:
    buckets = token_buckets(2048)
    assert [pick_bucket(buckets, n) for n in (1, 2, 3, 5, 17, 2048)] == [1, 2, 4, 8, 32, 2048]


def test_smallest_must_be_positive() -> None:
    with pytest.raises(ValueError, match="smallest must be >= 1"):
        token_buckets(2048, smallest=0)
