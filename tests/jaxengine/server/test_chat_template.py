"""Chat templates sent with a request run the client's Jinja on the server: refused unless the
server was started with --trust-request-chat-template (vLLM's flag); rendered in a worker
thread, and refused when they render more than the context can hold."""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from transformers import PreTrainedTokenizerBase

from jaxengine.server.args import FrontendArgs
from jaxengine.server.chat_protocol import _RENDER_ARGS
from tests.jaxengine.server.test_harness import (
    MODEL_NAME,
    RunningServer,
    shared_server,
    start_server,
)

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "ok"}], "max_tokens": 2,
        "ignore_eos": True}
TOKENIZE = {"messages": [{"role": "user", "content": "ok"}]}
EXCLAIM = "{{ messages[0]['content'] }}!"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    """A server that trusts request templates (none of these tests generates: no compiling)."""
    running = start_server(app_args={"frontend": FrontendArgs(trust_request_chat_template=True)})
    yield running
    running.stop()


@pytest.fixture(scope="module")
def untrusting(pytestconfig: pytest.Config) -> RunningServer:
    """The shared server, started without the flag."""
    return shared_server(pytestconfig)


def _post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/{path}", json=body, trust_env=False, timeout=60)


@pytest.mark.parametrize(("path", "body"), [("v1/chat/completions", CHAT),
                                            ("tokenize", TOKENIZE)])
def test_a_request_template_is_refused_unless_the_server_trusts_them(
        untrusting: RunningServer, path: str, body: dict[str, Any]) -> None:
    r = _post(untrusting, path, {**body, "chat_template": EXCLAIM})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chat_template"
    assert "--trust-request-chat-template" in error["message"]
    assert _post(untrusting, path, body).status_code == 200


@pytest.mark.parametrize("kwargs", [{"chat_template": EXCLAIM}, {"tokenize": True},
                                    {"add_generation_prompt": False}, {"return_dict": True},
                                    {"messages": []}])
def test_template_kwargs_may_not_set_rendering_arguments(untrusting: RunningServer,
                                                         kwargs: dict[str, Any]) -> None:
    # they reached transformers' apply_chat_template, whose TypeError named it to the client
    r = _post(untrusting, "v1/chat/completions", {**CHAT, "chat_template_kwargs": kwargs})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chat_template_kwargs"
    assert f"may not set '{next(iter(kwargs))}'" in error["message"]
    assert "apply_chat_template" not in error["message"]


def test_template_variables_are_passed(untrusting: RunningServer) -> None:
    r = _post(untrusting, "tokenize", {**TOKENIZE, "chat_template_kwargs": {"x": 1}})
    assert r.status_code == 200, r.text


def test_a_trusting_server_renders_the_requests_template(server: RunningServer) -> None:
    r = _post(server, "tokenize", {**TOKENIZE, "chat_template": EXCLAIM})
    assert r.status_code == 200, r.text
    text = _post(server, "detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text == "ok!"


def test_a_template_that_renders_too_long_is_refused_before_tokenizing(server: RunningServer
                                                                      ) -> None:
    limit = server.app.state.serving.limits.max_prompt_chars
    template = "{% for i in range(" + str(limit + 1) + ") %}x{% endfor %}"
    for path, body in (("v1/chat/completions", CHAT), ("tokenize", TOKENIZE)):
        r = _post(server, path, {**body, "chat_template": template})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages"
        assert f"the prompt has {limit + 1} characters" in r.json()["error"]["message"]


def test_health_answers_while_a_request_is_prepared(server: RunningServer) -> None:
    # A chat template that takes seconds to render: the rendering runs in a worker thread,
    # and the event loop goes on answering meanwhile. (max_tokens is refused once the prompt
    # is tokenized: the request's time is its preparation, not a first step's compilation.)
    slow = ("{% for i in range(20000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"
            "{{ messages[0]['content'] }}")
    done: list[float] = []

    def chat() -> None:
        start = time.perf_counter()
        r = _post(server, "v1/chat/completions", {**CHAT, "chat_template": slow,
                                                   "max_tokens": 10_000})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        done.append(time.perf_counter() - start)

    worker = threading.Thread(target=chat)
    worker.start()
    waits = []
    with httpx.Client(base_url=server.base_url, trust_env=False, timeout=60) as http:
        while worker.is_alive():
            start = time.perf_counter()
            assert http.get("/health").status_code == 200
            waits.append(time.perf_counter() - start)
            time.sleep(0.05)
    worker.join()
    assert done and len(waits) >= 5, "the template rendered too fast to test anything"
    # Rendered on the event loop, one /health would wait for the whole rendering; here each
    # waits for a GIL switch (or, rarely, a garbage collection of this big test process).
    assert sorted(waits)[len(waits) // 2] < 0.1 and max(waits) < done[0] / 2, \
        (done, sorted(waits)[-3:])


def test_the_refused_template_variables_are_transformers_rendering_arguments() -> None:
    # spelled out in chat_protocol so the server imports no transformers to start
    rendering = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
    assert rendering - {"self", "conversation", "kwargs"} | {"messages"} == _RENDER_ARGS
