"""`AsyncEngine` over the fake-model engine, without HTTP: joining, aborting, a failing step."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from jaxengine.model.fake import fake_greedy
from jaxengine.server.async_engine import AsyncEngine, EngineDeadError
from scheduler import SamplingParams
from tests.jaxengine.engine.test_llm_engine import PROMPTS, FakeTokenizer, V, make_engine
from tests.jaxengine.metrics.test_metrics import _value

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


def _run(coro: Coroutine[Any, Any, Any], timeout_s: float = 120.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def _started(**kw: Any) -> AsyncEngine:
    engine = AsyncEngine(make_engine(**kw), model_name="fake", log_interval=0)
    engine.start()
    return engine


def _all_blocks_free(engine: AsyncEngine) -> bool:
    e = engine.engine
    return e.snapshot().num_free_blocks == e.scheduler_config.num_blocks - 1


def test_late_requests_join_the_running_batch_and_get_the_same_tokens() -> None:
    async def scenario() -> None:
        engine = await _started()
        first = await engine.add("a", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
        outputs = [await anext(aiter(first))]  # "a" is running now
        late = await engine.add("b", {"prompt_token_ids": PROMPTS[2]}, GREEDY)
        outputs += [o async for o in first]
        (b_final,) = [o async for o in late][-1:]
        assert list(outputs[-1].outputs[0].token_ids) == fake_greedy(PROMPTS[0], 8, V)
        assert list(b_final.outputs[0].token_ids) == fake_greedy(PROMPTS[2], 8, V)
        assert engine.engine.snapshot().stats.num_running == 0 and _all_blocks_free(engine)
        await engine.stop()

    _run(scenario())


def test_a_stop_string_ends_the_stream_as_stop_and_is_counted_so() -> None:
    async def scenario() -> None:
        engine = await _started()
        stop = FakeTokenizer().decode(fake_greedy(PROMPTS[2], 4, V)[2:4])
        stream = await engine.add("s", {"prompt_token_ids": PROMPTS[2]},
                                  SamplingParams(max_tokens=50, temperature=0.0, stop=[stop]))
        final = await stream.final()
        assert final is not None and final.outputs[0].finish_reason == "stop"
        assert final.outputs[0].stop_reason == stop and len(final.outputs[0].token_ids) == 4
        assert _all_blocks_free(engine) and engine.num_unfinished() == 0
        text = engine.metrics.render().decode()
        for reason, count in (("stop", 1), ("abort", 0), ("length", 0)):
            assert _value(text, "jaxengine:request_success_total",
                          finished_reason=reason) == count
        assert _value(text, "jaxengine:generation_tokens_total") == 4
        await engine.stop()

    _run(scenario())


def test_abort_frees_the_blocks_and_the_loop_goes_on() -> None:
    async def scenario() -> None:
        engine = await _started()
        stream = await engine.add("long", {"prompt_token_ids": PROMPTS[1]}, LONG)
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break
        stream.abort()
        other = await engine.add("short", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
        final = await other.final()
        assert final is not None and len(final.outputs[0].token_ids) == 8
        for _ in range(200):  # bounded wait for the idle loop
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert _all_blocks_free(engine) and engine.num_unfinished() == 0
        await engine.stop()

    _run(scenario())


def test_a_bad_request_raises_value_error_and_changes_nothing() -> None:
    async def scenario() -> None:
        engine = await _started()
        with pytest.raises(ValueError, match="temperature"):
            await engine.add("x", {"prompt_token_ids": [1, 2]},
                             SamplingParams(temperature=-1.0))
        assert engine.num_unfinished() == 0 and not engine.engine.has_unfinished_requests()
        await engine.stop()

    _run(scenario())


def test_a_failing_step_fails_its_requests_and_the_next_ones_still_run() -> None:
    async def scenario() -> None:
        engine = await _started()
        real_step, calls = engine.engine.step, [0]

        def flaky_step() -> Any:
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("device fell over")
            return real_step()

        engine.engine.step = flaky_step  # type: ignore[method-assign]
        doomed = await engine.add("doomed", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
        with pytest.raises(EngineDeadError, match="engine failed") as failed:
            async for _ in doomed:
                pass
        # The client's message names no internals; the cause stays with the error (and log).
        assert "device fell over" not in str(failed.value) and failed.value.code == 500
        assert str(failed.value.__cause__) == "device fell over"
        assert _all_blocks_free(engine) and engine.is_running()
        fine = await engine.add("fine", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
        final = await fine.final()
        assert final is not None and list(final.outputs[0].token_ids) == fake_greedy(
            PROMPTS[0], 8, V)
        await engine.stop()
        with pytest.raises(EngineDeadError) as stopped:
            await engine.add("after", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
        assert stopped.value.code == 503

    _run(scenario())


def test_final_aborts_when_the_client_is_gone() -> None:
    async def scenario() -> None:
        engine = await _started()
        stream = await engine.add("gone", {"prompt_token_ids": PROMPTS[1]}, LONG)

        async def disconnected() -> bool:
            return True

        assert await stream.final(disconnected, poll_s=0.01) is None
        for _ in range(200):
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert _all_blocks_free(engine)
        await engine.stop()

    _run(scenario())


def test_a_reader_that_lags_holds_one_output_and_gets_every_token_in_it() -> None:
    """Outputs are cumulative, so a stream keeps only its newest unread one: a client that
    stops reading costs one output of its request, not one per step (each as long as the text
    so far: memory quadratic in the length), and it still gets every token."""
    async def scenario() -> None:
        engine = await _started()
        stream = await engine.add("lag", {"prompt_token_ids": PROMPTS[0]}, LONG)
        while engine.engine.has_unfinished_requests():
            await asyncio.sleep(0.01)
            assert len(stream._unread) <= 1
        outputs = [o async for o in stream]
        assert len(outputs) == 1 and outputs[0].finished
        assert list(outputs[0].outputs[0].token_ids) == fake_greedy(PROMPTS[0], 200, V)
        await engine.stop()

    _run(scenario())
