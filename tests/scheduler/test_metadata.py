"""Request metadata (tenant, user, ...) is an immutable copy, carried through the scheduler."""

import dataclasses

import pytest

from scheduler import Request, RequestMetadata, SchedulerConfig, schedule

from .util import state_with

CFG = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=2, max_model_len=16,
                      block_size=4, num_blocks=20)


def test_metadata_is_a_read_only_copy():
    source = {"tenant": "a", "user": "u1"}
    r = Request(request_id="x", prompt_token_ids=(1, 2), metadata=source)
    source["tenant"] = "b"
    assert dict(r.metadata) == {"tenant": "a", "user": "u1"}
    with pytest.raises(TypeError):
        r.metadata["tenant"] = "c"  # type: ignore[index]
    assert r == Request(request_id="x", prompt_token_ids=(1, 2), metadata={"user": "u1",
                                                                          "tenant": "a"})
    assert r != Request(request_id="x", prompt_token_ids=(1, 2))
    assert hash(r) == hash(dataclasses.replace(r))  # requests stay hashable
    assert dataclasses.replace(r, priority=3).metadata is r.metadata  # not copied again


def test_default_metadata_is_empty():
    r = Request(request_id="x", prompt_token_ids=(1,))
    assert isinstance(r.metadata, RequestMetadata) and dict(r.metadata) == {}


@pytest.mark.parametrize("bad, words", [
    (["tenant", "a"], "must be a mapping"),
    ({1: "a"}, "use str keys"),
    ({"tenant": ["a"]}, "metadata['tenant'] is a list"),
])
def test_bad_metadata_says_what_to_change(bad, words):
    with pytest.raises(ValueError, match="request 'x'") as e:
        Request(request_id="x", prompt_token_ids=(1,), metadata=bad)
    assert words in str(e.value)


def test_metadata_survives_scheduling():
    r = Request(request_id="x", prompt_token_ids=(1, 2, 3), metadata={"tenant": "a"})
    s, _ = schedule(state_with(CFG, r))
    assert s.requests["x"].metadata == {"tenant": "a"}
