"""What one request may ask for is bounded before any work is done for it (server/limits.py):
a request over a bound is a fast 400 naming the field, and the server goes on serving."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from jaxengine.server.limits import MAX_CHOICES
from tests.jaxengine.server.test_harness import ENGINE_ARGS, MODEL_NAME, RunningServer

COMPLETION = {"model": MODEL_NAME, "prompt": "ok", "max_tokens": 2, "ignore_eos": True}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "ok"}], "max_tokens": 2,
        "ignore_eos": True}
MAX_N = ENGINE_ARGS["max_num_seqs"]


def _post(server: RunningServer, endpoint: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/{endpoint}", json=body, trust_env=False,
                      timeout=60)


def _refused_fast(server: RunningServer, endpoint: str, body: dict[str, Any],
                  param: str) -> dict[str, Any]:
    """Post `body`; check it is a 400 naming `param` within a second; return the error."""
    start = time.perf_counter()
    r = _post(server, endpoint, body)
    elapsed = time.perf_counter() - start
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert elapsed < 1.0, f"refused after {elapsed:.2f} s"
    return error


@pytest.mark.parametrize(("endpoint", "good"), [("completions", COMPLETION),
                                                ("chat/completions", CHAT)])
@pytest.mark.parametrize("n", [MAX_N + 1, 30_000, 1_000_000_000])
def test_n_beyond_max_num_seqs_is_refused_before_any_work(server: RunningServer, endpoint: str,
                                                          good: dict[str, Any], n: int) -> None:
    # n = 1e9 grew the process to 20 GB until it was killed; 30000 held /health for 15 s.
    error = _refused_fast(server, endpoint, {**good, "n": n, "best_of": n}, "n")
    assert f"n must be at most {MAX_N}, got {n}" in error["message"]
    assert _post(server, endpoint, good).status_code == 200


def test_prompts_times_n_is_bounded(server: RunningServer) -> None:
    prompts = ["ok"] * (MAX_CHOICES // MAX_N + 1)
    error = _refused_fast(server, "completions", {**COMPLETION, "prompt": prompts, "n": MAX_N},
                          "prompt")
    assert f"at most {MAX_CHOICES}" in error["message"]
    _refused_fast(server, "completions", {**COMPLETION, "prompt": [[5]] * (MAX_CHOICES + 1)},
                  "prompt")
