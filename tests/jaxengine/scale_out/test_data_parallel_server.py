"""A data-parallel engine behind the server: requests spread over replicas, `/metrics` has an
`engine` label per replica (through the real HTTP server), aborts reach the owner."""

from __future__ import annotations

import asyncio
import time

import httpx

from jaxengine.model.fake import fake_greedy
from jaxengine.replicas.data_parallel import DataParallelEngine
from jaxengine.server.async_engine import AsyncEngine
from scheduler import SamplingParams
from tests.jaxengine.engine.test_llm_engine import PROMPTS, FakeTokenizer, V, make_engine
from tests.jaxengine.metrics.test_metrics import _value
from tests.jaxengine.server.test_harness import MODEL_NAME, serve_engine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _dp() -> DataParallelEngine:
    return DataParallelEngine([make_engine(), make_engine()])


def test_the_async_engine_spreads_requests_and_aborts_on_the_owner() -> None:
    async def scenario() -> None:
        dp = _dp()
        engine = AsyncEngine(dp, model_name="fake", log_interval=0)
        engine.start()
        # Both join before the next step (no await yields in between): load sends b to 1.
        a = await engine.add("a", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
        b = await engine.add("b", {"prompt_token_ids": PROMPTS[1]},
                             SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        assert (dp.replica_of("a"), dp.replica_of("b")) == (0, 1)
        first_b = await anext(aiter(b))
        assert list(first_b.outputs[0].token_ids) == fake_greedy(PROMPTS[1], 1, V)
        final_a = await a.final()
        assert final_a is not None
        assert list(final_a.outputs[0].token_ids) == fake_greedy(PROMPTS[0], 8, V)
        b.abort()
        for _ in range(200):  # the loop applies the abort before its next step
            if not dp.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        r1 = dp.replicas[1].snapshot()
        assert r1.num_free_blocks == r1.config.num_blocks - 1
        engine.refresh_gauges()
        text = engine.metrics.render().decode()
        success = "jaxengine:request_success_total"
        assert _value(text, success, engine="0", finished_reason="length") == 1
        assert _value(text, success, engine="1", finished_reason="abort") == 1
        assert _value(text, success, engine="1", finished_reason="length") == 0
        assert engine.stat_logger.log().startswith("Avg prompt throughput")
        await engine.stop()

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_metrics_over_http_have_a_series_per_replica() -> None:
    dp = _dp()
    running = serve_engine(dp)
    try:
        with httpx.Client(base_url=running.base_url, timeout=60) as client:
            long = {"model": MODEL_NAME, "prompt": FakeTokenizer().decode(PROMPTS[1]),
                    "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
            with client.stream("POST", "/v1/completions", json=long) as stream:
                # The first chunk: the long request runs on 0. Keep the line iterator: a
                # discarded one closes the connection, and the server aborts the request.
                lines = stream.iter_lines()
                next(lines)
                short = {"model": MODEL_NAME, "prompt": FakeTokenizer().decode(PROMPTS[0]),
                         "max_tokens": 5, "ignore_eos": True, "temperature": 0}
                body = client.post("/v1/completions", json=short).json()
                assert body["usage"]["completion_tokens"] == 5
            # Leaving the stream aborts the long request; wait (bounded) until it counts.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                text = client.get("/metrics").text
                if _value(text, "jaxengine:request_success_total", finished_reason="abort"):
                    break
                time.sleep(0.05)
    finally:
        running.stop()
    success = "jaxengine:request_success_total"
    assert _value(text, success, engine="0", finished_reason="abort") == 1
    assert _value(text, success, engine="1", finished_reason="length") == 1
    assert _value(text, success, engine="0", finished_reason="length") == 0
    assert _value(text, "jaxengine:generation_tokens_total", engine="1") == 5
    assert _value(text, "jaxengine:prompt_tokens_total") == len(PROMPTS[0]) + len(PROMPTS[1])
    for name in ("jaxengine:num_requests_running", "jaxengine:kv_cache_usage_perc",
                 "jaxengine:prefix_cache_queries_total"):
        for replica in ("0", "1"):
            assert f'{name}{{engine="{replica}",model_name="{MODEL_NAME}"}}' in text
