"""Warm-up before serving: /health is 200 only after every bucket compiled, and afterwards no
request compiles anything, whatever its size (through the real HTTP server)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from jaxengine.replicas.data_parallel import DataParallelEngine
from jaxengine.runner.compiles import DEBUG_ENV
from jaxengine.server import build_app
from jaxengine.server.warmup import warm_up
from tests.jaxengine.engine.test_llm_engine import make_engine
from tests.jaxengine.server.test_harness import (
    MODEL_NAME,
    TINY,
    start_server,
    wait_until_idle,
)
from tests.parallel_helpers import REPO, device_env
from tests.server_processes import free_port, stop, wait_healthy

# Three token buckets and two request buckets (whatever the bucket rule makes of these sizes);
# a 100-token prompt is prefilled in two chunks.
WARM_ARGS: dict[str, Any] = dict(max_num_batched_tokens=64, max_num_seqs=16, block_size=4,
                                 max_model_len=128, num_gpu_blocks_override=400,
                                 debug_recompiles=True)
VOCAB = 128  # the tiny fixture's vocabulary


def _complete(base: str, prompt: list[int], max_tokens: int, *, stream: bool = False) -> int:
    """POST one completion of token ids (streamed or not); the completion tokens it reports."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    if not stream:
        r = httpx.post(f"{base}/v1/completions", json=body, trust_env=False, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["completion_tokens"]
    usage = None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, trust_env=False,
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                assert "error" not in chunk, chunk
                usage = chunk.get("usage") or usage
    assert usage is not None, "the stream ended without its usage chunk"
    return usage["completion_tokens"]


def test_after_health_no_request_of_any_size_compiles() -> None:
    running = start_server(warm_up=True, **WARM_ARGS)
    try:
        runner = running.engine.runner
        assert runner.warm and runner.config.debug_recompiles
        r = httpx.get(f"{running.base_url}/health", trust_env=False, timeout=10)
        assert r.status_code == 200
        base = running.base_url
        # Served while the larger buckets may still be made in the background.
        assert _complete(base, [5], 3) == 3  # one token in, decode steps alone
        runner.wait_for_programs()
        # The warm-up compiled each program once (the slot writer unless an earlier runner of
        # these shapes in this process did), before /health or in the background.
        compiled = runner.stats.compilations
        assert runner.num_programs - 1 <= compiled <= runner.num_programs
        assert _complete(base, [(7 * i) % VOCAB for i in range(100)], 4) == 4  # chunked
        # Prompt logprobs (in the step, over both chunks) and echo with them compile nothing.
        r = httpx.post(f"{base}/v1/completions", trust_env=False, timeout=120, json={
            "model": MODEL_NAME, "prompt": [(5 * i) % VOCAB for i in range(100)],
            "max_tokens": 2, "echo": True, "logprobs": 3, "prompt_logprobs": 2})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["prompt_logprobs"]) == 100
        # Sixteen streams at once, prompts of 1 to 46 tokens: every request bucket, and
        # prefill steps of many sizes up to the full token budget.
        prompts = [[(3 * i + j) % VOCAB for j in range(1 + 3 * i)] for i in range(16)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: _complete(base, p, 12, stream=True), prompts))
        assert got == [12] * len(prompts)
        wait_until_idle(running)
        stats = runner.stats
        assert stats.compilations_after_warmup == 0 and stats.compilations == compiled
        assert stats.steps > 16  # the workload ran on the engine, not around it
    finally:
        running.stop()


def test_health_is_503_until_the_warm_up_is_over() -> None:
    engine = make_engine()  # the fake model: cheap to compile
    runner, entered, release = engine.runner, threading.Event(), threading.Event()
    precompile = runner.precompile

    def held_precompile(*args: Any, **kw: Any) -> None:  # a hook: the real one, once released
        entered.set()
        assert release.wait(timeout=120)
        precompile(*args, **kw)

    runner.precompile = held_precompile  # type: ignore[method-assign]
    app = build_app(engine, model_name=MODEL_NAME, log_interval=0)

    async def scenario() -> None:
        # ASGITransport sends requests without running the lifespan, which runs here.
        transport = httpx.ASGITransport(app=app)
        async with (httpx.AsyncClient(transport=transport, base_url="http://app") as client,
                    contextlib.AsyncExitStack() as stack):
            starting = asyncio.create_task(
                stack.enter_async_context(app.router.lifespan_context(app)))
            assert await asyncio.to_thread(entered.wait, 120)  # inside the warm-up now
            assert (await client.get("/health")).status_code == 503
            assert not runner.warm
            release.set()
            await starting
            assert runner.warm
            assert (await client.get("/health")).status_code == 200

    asyncio.run(asyncio.wait_for(scenario(), 300))


def test_warm_up_compiles_only_the_cold_replicas() -> None:
    warm, cold = make_engine(), make_engine()
    warm.runner.precompile(progress=False)
    done = warm_up(DataParallelEngine([warm, cold]))
    assert done.replicas == 1 and cold.runner.warm
    # Programs another runner over the same fake model compiled are reused, not counted.
    assert 0 <= done.cache_hits <= done.programs <= (
        len(cold.runner.token_buckets) + len(cold.runner.request_buckets))
    again = warm_up(DataParallelEngine([warm, cold]))
    assert (again.replicas, again.programs, again.cache_hits) == (0, 0, 0)


@pytest.mark.slow  # about 35 s on 2 busy cores: two replicas compile 7 programs each
def test_serve_warms_every_replica_before_it_listens(tmp_path: Path) -> None:
    """`jaxengine serve` with two data-parallel replicas and debug_recompiles from the
    environment: the log has each replica's plan and the summary before uvicorn's startup, and
    a line per bucket of each replica (the larger ones made in the background); requests of
    very different sizes then succeed (a compilation would fail its step)."""
    port, log = free_port(), tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "jaxengine", "serve", str(TINY), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", MODEL_NAME, "--data-parallel-size", "2",
           "--max-num-batched-tokens", "32", "--max-num-seqs", "4", "--block-size", "4",
           "--max-model-len", "64", "--num-gpu-blocks-override", "64"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env=device_env(2, {DEBUG_ENV: "1"}), start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, [proc], lambda: log.read_text(errors="replace")[-4000:])
        text = log.read_text()
        for prompt in ([5], [(7 * i) % VOCAB for i in range(50)], [9, 8, 7]):  # 50: chunked
            assert _complete(base, prompt, 4) == 4
        with ThreadPoolExecutor(6) as pool:  # more than one replica's max_num_seqs
            got = list(pool.map(lambda n: _complete(base, list(range(1, n + 1)), 6,
                                                    stream=True), range(1, 7)))
        assert got == [6] * 6
    finally:
        stop(proc)
    startup = text.index("Application startup complete")
    warm = text[:startup]
    plans = re.findall(r"warm-up: compiling replica (\d) of 2 \(\d+ token buckets \[([\d, ]+)\], "
                       r"\d+ request buckets \[([\d, ]+)\]\)", warm)
    assert [p[0] for p in plans] == ["0", "1"], warm
    assert plans[0][1:] == plans[1][1:] and "32" in plans[0][1].split(", ")
    made = log.read_text()  # the larger buckets are made in the background after /health
    for kind, sizes, unit in (("step", plans[0][1], "tokens"), ("sample", plans[0][2],
                                                                "requests")):
        for size in sizes.split(", "):  # every bucket, once per replica, with its time
            assert len(re.findall(rf"compiled {kind} for {size} {unit} in [\d.]+ s", made)) == 2
    assert "warm-up done in " in warm and "no request compiles from now on" in warm
    assert warm.index("warm-up done in ") < warm.index("engine ready: 2 replica(s)")
    assert "RecompileError" not in log.read_text()
