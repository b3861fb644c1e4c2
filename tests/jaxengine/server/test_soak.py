"""The server under a long mixed load (slow): a few thousand requests over HTTP through the
official client with random sampling parameters, `n`, stop strings and structured outputs, one
stream in ten left mid-way. Afterwards every KV block is free, no request is left running or
waiting, resident memory has stayed flat since the warm-up, and a greedy request gives the text
it gave before the soak."""

from __future__ import annotations

import asyncio
import gc
import os
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.jaxengine.server.test_harness import (
    MODEL_NAME,
    RunningServer,
    start_server,
    wait_until_idle,
)

pytestmark = pytest.mark.slow

REQUESTS = 3000
WARM_UP = 300  # requests before the resident-memory baseline (allocator pools, caches)
CONCURRENCY = 16
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "Hello", "a b c d e f"]
CHOICES = ["yes", "no", "maybe"]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server()
    yield running
    running.stop()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _random_request(rng: random.Random) -> dict[str, Any]:
    """Keyword arguments of a completion: random sampling fields, `n`, stop strings, and now
    and then a grammar."""
    kw: dict[str, Any] = dict(model=MODEL_NAME, prompt=rng.choice(PROMPTS),
                              max_tokens=rng.randint(1, 24),
                              temperature=rng.choice([0.0, 0.5, 1.0, 1.5]),
                              n=rng.choice([1, 1, 1, 2, 3]), seed=rng.randint(0, 10**6))
    extra: dict[str, Any] = {}
    if rng.random() < 0.3:
        kw["top_p"] = rng.uniform(0.1, 1.0)
        extra["top_k"] = rng.randint(1, 50)
    if rng.random() < 0.2:
        kw["presence_penalty"] = rng.uniform(-1, 1)
        kw["frequency_penalty"] = rng.uniform(-1, 1)
    if rng.random() < 0.2:
        kw["stop"] = rng.sample(["a", "e", " the", "\n", "."], k=2)
    if rng.random() < 0.1:
        kw["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.1:
        extra["structured_outputs"] = rng.choice([{"choice": CHOICES},
                                                   {"regex": "[a-c]{1,4}!"}])
    if extra:
        kw["extra_body"] = extra
    return kw


async def _one(client: openai.AsyncOpenAI, rng: random.Random, counts: Counter) -> None:
    kw = _random_request(rng)
    if rng.random() < 0.5:
        completion = await client.completions.create(**kw)
        counts["finished"] += len(completion.choices)
        return
    stream = await client.completions.create(stream=True, **kw)
    leave_after = rng.randint(1, 3) if rng.random() < 0.1 else None
    chunks = 0
    async for _ in stream:
        chunks += 1
        if chunks == leave_after:
            await stream.close()  # the client leaves mid-stream
            counts["left"] += 1
            return
    counts["streamed"] += 1


async def _soak(base_url: str) -> tuple[Counter, float]:
    rng = random.Random(0)
    counts: Counter = Counter()
    baseline = [0.0]
    queue = iter(range(REQUESTS))
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0,
                                  timeout=120,
                                  http_client=httpx.AsyncClient(trust_env=False)) as client:
        async def worker() -> None:
            for i in queue:
                if i == WARM_UP:
                    gc.collect()
                    baseline[0] = _rss_mb()
                await _one(client, random.Random(rng.random()), counts)

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return counts, baseline[0]


def _greedy(base_url: str) -> str:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60,
                       http_client=httpx.Client(trust_env=False)) as client:
        return client.completions.create(model=MODEL_NAME, prompt="The capital of France is",
                                         max_tokens=16, temperature=0.0).choices[0].text


def test_a_soak_of_mixed_requests_leaves_the_engine_as_it_found_it(
        server: RunningServer) -> None:
    before = _greedy(server.base_url)
    counts, baseline = asyncio.run(_soak(server.base_url))
    assert counts["left"] > REQUESTS // 50 and counts["streamed"] > 0
    assert counts["finished"] > 0
    wait_until_idle(server, timeout_s=60)  # every block free, nothing running or waiting
    state = server.engine.snapshot()
    assert state.waiting == () and state.running == ()
    gc.collect()
    grown = _rss_mb() - baseline
    assert grown < 150, f"resident memory grew {grown:.0f} MB after the warm-up"
    assert _greedy(server.base_url) == before
