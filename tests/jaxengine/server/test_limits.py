"""What one request may ask for is bounded before any work is done for it (server/limits.py):
a request over a bound is a fast 400 naming the field, and the server goes on serving."""

from __future__ import annotations

import time
from collections.abc import Callable
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
    """Post `body`; check it is a 400 naming `param` within 5 s; return the error.

    5 s is far from what the work refused would take (20M characters tokenized, n=30000
    held /health for 15 s), and far from a loaded machine's scheduling delays (a 1 s bound
    failed once at load average 11 on 2 cores)."""
    start = time.perf_counter()
    r = _post(server, endpoint, body)
    elapsed = time.perf_counter() - start
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert elapsed < 5.0, f"refused after {elapsed:.2f} s"
    return error


@pytest.mark.parametrize(("endpoint", "good"), [("completions", COMPLETION),
                                                ("chat/completions", CHAT)])
@pytest.mark.parametrize("n", [MAX_N + 1, 30_000, 1_000_000_000])
def test_n_beyond_max_num_seqs_is_refused_before_any_work(server: RunningServer, endpoint: str,
                                                          good: dict[str, Any], n: int) -> None:
    # Unbounded, n = 1e9 grows the process until it is killed and 30000 holds /health for 15 s.
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


def _max_prompt_chars(server: RunningServer) -> int:
    limit = server.app.state.serving.limits.max_prompt_chars
    # the tiny tokenizer's longest token is "<|endoftext|>"; it has no normalizer
    assert limit == ENGINE_ARGS["max_model_len"] * len("<|endoftext|>")
    return limit


def _rss_bytes() -> int:
    """This process's resident memory (the test server runs in it)."""
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb * 1024


# (endpoint under /v1, the body with a prompt text, the field that holds it)
PROMPTS = [
    ("completions", lambda text: {**COMPLETION, "prompt": text}, "prompt"),
    ("chat/completions", lambda text: {**CHAT, "messages": [{"role": "user", "content": text}]},
     "messages"),
    ("../tokenize", lambda text: {"model": MODEL_NAME, "prompt": text}, "prompt"),
    ("../tokenize", lambda text: {"messages": [{"role": "user", "content": text}]}, "messages"),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), PROMPTS,
                         ids=[f"{e}-{p}" for e, _, p in PROMPTS])
def test_a_prompt_longer_than_the_context_can_hold_is_refused_before_tokenizing(
        server: RunningServer, endpoint: str, body: Callable[[str], dict[str, Any]],
        param: str) -> None:
    limit = _max_prompt_chars(server)
    error = _refused_fast(server, endpoint, body("x" * (limit + 1)), param)
    assert f"at most {limit} characters" in error["message"]
    # 20 MB: tokenized, it would be 20M tokens and gigabytes of lists; refused, it costs its
    # parsing, and the memory goes back (what stays is the allocator's slack: 0 to 60 MB in
    # this test process, which runs much else).
    big = body("y" * 20_000_000)
    _refused_fast(server, endpoint, big, param)
    before = _rss_bytes()
    for _ in range(3):
        _refused_fast(server, endpoint, big, param)
    assert _rss_bytes() - before < 200 << 20, "the process kept what refused requests took"
    assert _post(server, endpoint, body("ok")).status_code == 200


def test_a_chat_that_renders_too_long_is_refused_before_tokenizing(server: RunningServer
                                                                   ) -> None:
    # the messages fit, the template's own text around them does not
    content = "x" * _max_prompt_chars(server)
    error = _refused_fast(server, "chat/completions",
                          {**CHAT, "messages": [{"role": "user", "content": content}]},
                          "messages")
    assert "shorten it" in error["message"]


def test_token_ids_beyond_the_context_are_refused_unless_truncated(server: RunningServer
                                                                   ) -> None:
    ids = [5] * 100_000
    error = _refused_fast(server, "completions", {**COMPLETION, "prompt": ids}, "prompt")
    assert "maximum context length is 128 tokens" in error["message"]
    r = _post(server, "completions", {**COMPLETION, "prompt": [5] * 500,
                                      "truncate_prompt_tokens": 8})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 8
