"""The bodies `vllm bench serve` sends (vllm/benchmarks/lib/endpoint_request_func.py: its
openai-completions and openai-chat backends, with --ignore-eos and the --presence-penalty
--frequency-penalty --repetition-penalty sampling extras) are served, and the stream has what
that client counts a success by: a first chunk with choices, then a usage chunk."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.jaxengine.server.test_harness import (
    MODEL_NAME,
    RunningServer,
    wait_until_idle,
)

MAX_TOKENS = 6
# vllm bench serve --presence-penalty 0.5 --frequency-penalty 0.5 --repetition-penalty 1.1
# --temperature 0.8 --top-p 0.9 --top-k 20 --ignore-eos: what it merges into the body
EXTRAS = {"ignore_eos": True, "presence_penalty": 0.5, "frequency_penalty": 0.5,
          "repetition_penalty": 1.1, "temperature": 0.8, "top_p": 0.9, "top_k": 20}
BODIES = {
    "completions": {"model": MODEL_NAME, "prompt": "benchmark prompt", "repetition_penalty": 1.0,
                    "max_tokens": MAX_TOKENS, "logprobs": None, "stream": True,
                    "stream_options": {"include_usage": True}},
    "chat/completions": {"model": MODEL_NAME, "max_completion_tokens": MAX_TOKENS,
                         "messages": [{"role": "user", "content": [
                             {"type": "text", "text": "benchmark prompt"}]}],
                         "stream": True, "stream_options": {"include_usage": True}},
}


@pytest.mark.parametrize("endpoint", list(BODIES))
@pytest.mark.parametrize("extras", [{}, EXTRAS], ids=["plain", "penalties"])
def test_vllm_bench_serve_requests_succeed(server: RunningServer, endpoint: str,
                                           extras: dict[str, Any]) -> None:
    body = {**BODIES[endpoint], **extras}
    with_choices, usage = 0, None
    with httpx.stream("POST", f"{server.base_url}/v1/{endpoint}", json=body, trust_env=False,
                      timeout=60, headers={"x-request-id": f"bench-{endpoint[:4]}-{len(extras)}"}
                      ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line.removeprefix("data: "))
            if data.get("choices"):
                with_choices += 1
            elif data.get("usage"):
                usage = data["usage"]
    assert with_choices >= 2
    assert usage is not None and usage["completion_tokens"] == MAX_TOKENS
    wait_until_idle(server)
