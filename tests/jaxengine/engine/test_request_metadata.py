"""`LLMEngine.add_request(metadata=...)` reaches the scheduler's request, read-only."""

from __future__ import annotations

import pytest

from tests.jaxengine.engine.test_llm_engine import make_engine

P = {"prompt_token_ids": [5, 6, 7, 8]}


def test_metadata_reaches_the_scheduler() -> None:
    engine = make_engine()
    tags = {"tenant": "a", "user": "u1"}
    engine.add_request("a", P, metadata=tags)
    engine.add_request("b", P)
    tags["tenant"] = "changed later"
    assert engine.state.requests["a"].metadata == {"tenant": "a", "user": "u1"}
    assert engine.state.requests["b"].metadata == {}


def test_bad_metadata_is_refused_and_the_engine_is_unchanged() -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="use str keys"):
        engine.add_request("a", P, metadata={1: "x"})
    assert not engine.has_unfinished_requests()


def test_data_parallel_and_lockstep_engines_pass_metadata_on() -> None:
    from jaxengine.replicas.data_parallel import DataParallelEngine
    from jaxengine.replicas.lockstep import NewRequest, StepInputs, apply_inputs, decode, encode
    from scheduler import SamplingParams

    dp = DataParallelEngine([make_engine(), make_engine()])
    where = dp.add_request("a", P, metadata={"tenant": "t"})
    assert dp.replicas[where.replica].state.requests["a"].metadata == {"tenant": "t"}

    sent = StepInputs(new_requests=(NewRequest(
        request_id="b", prompt=[5, 6], params=SamplingParams(), arrival_time=1.0, priority=0,
        metadata={"tenant": "t", "user": "u"}),))
    follower = make_engine()
    apply_inputs(follower, decode(encode(sent)))  # what a follower process does
    assert follower.state.requests["b"].metadata == {"tenant": "t", "user": "u"}
