"""OpenAI's `user` and jaxengine's `tenant` extension reach the scheduler as request metadata."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from jaxengine.server.chat_protocol import ChatCompletionRequest
from jaxengine.server.protocol import CompletionRequest
from tests.jaxengine.server.test_harness import (
    MODEL_NAME,
    RunningServer,
    wait_until_idle,
)


def test_the_body_gives_user_and_tenant_only_where_set() -> None:
    body = CompletionRequest(prompt="x", user="u1", tenant="acme")
    assert body.metadata_of_request() == {"user": "u1", "tenant": "acme"}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], user="u2")
    assert chat.metadata_of_request() == {"user": "u2"}
    assert CompletionRequest(prompt="x").metadata_of_request() == {}


def test_metadata_reaches_the_engines_requests(server: RunningServer,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    engine = server.engine
    seen: dict[str, Any] = {}
    add = engine.add_request

    def recording_add(request_id: str, *args: Any, **kw: Any) -> None:
        add(request_id, *args, **kw)  # the scheduler's copy, read right after it is made
        seen[request_id] = dict(engine.state.requests[request_id].metadata)

    monkeypatch.setattr(engine, "add_request", recording_add)
    url = f"{server.base_url}/v1"
    with httpx.Client(trust_env=False, timeout=120) as http:
        r = http.post(f"{url}/completions", json={
            "model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "ignore_eos": True,
            "user": "u1", "tenant": "acme"})
        assert r.status_code == 200, r.text
        r = http.post(f"{url}/chat/completions", json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200, r.text
    wait_until_idle(server)
    assert sorted(seen.values(), key=len) == [{}, {"user": "u1", "tenant": "acme"}]
