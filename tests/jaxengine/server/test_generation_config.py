"""The model's generation_config.json fills the sampling fields a request leaves unset."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from jaxengine.server.chat_protocol import ChatCompletionRequest
from jaxengine.server.protocol import CompletionRequest
from scheduler import SamplingParams
from tests.jaxengine.server.test_harness import (
    MODEL_NAME,
    TINY,
    RunningServer,
    start_server,
    wait_until_idle,
)

# Greedy by default, 5 tokens, top_k 7, repetition penalty 1.3; do_sample is not a default.
GENERATION_CONFIG = {"temperature": 0.0, "top_k": 7, "max_new_tokens": 5,
                     "repetition_penalty": 1.3, "do_sample": True}
MESSAGES = [{"role": "user", "content": "Tell me a story"}]


def test_unset_fields_take_the_defaults_and_set_ones_win() -> None:
    defaults = {"temperature": 0.0, "top_p": 0.5, "top_k": 7, "min_p": 0.1, "max_tokens": 5}
    body = CompletionRequest(prompt="x", top_p=0.9, top_k=0)
    assert body.sampling_params(3, None, defaults) == SamplingParams(
        max_tokens=3, temperature=0.0, top_p=0.9, top_k=0, min_p=0.1)
    chat = ChatCompletionRequest(messages=MESSAGES, temperature=1.5)
    assert chat.sampling_params(4, None, defaults) == SamplingParams(
        max_tokens=4, temperature=1.5, top_p=0.5, top_k=7, min_p=0.1)
    assert chat.sampling_params(4, None) == SamplingParams(max_tokens=4, temperature=1.5)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model = tmp_path_factory.mktemp("model") / "tiny"
    shutil.copytree(TINY, model)
    (model / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    running = start_server(model=str(model))
    yield running
    running.stop()


def _post(server: RunningServer, endpoint: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{server.base_url}/v1/{endpoint}", json={"model": MODEL_NAME, **body},
                   trust_env=False, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _chat_text(server: RunningServer, **body: Any) -> tuple[str, int]:
    out = _post(server, "chat/completions", messages=MESSAGES, ignore_eos=True, **body)
    return out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"]


def test_the_server_takes_the_keys_it_implements(server: RunningServer) -> None:
    assert server.app.state.serving.default_sampling_params == {
        "temperature": 0.0, "top_k": 7, "repetition_penalty": 1.3, "max_tokens": 5}


def test_max_tokens_default_applies_where_vllm_applies_it(server: RunningServer) -> None:
    assert _chat_text(server)[1] == 5  # chat: unset max_tokens -> max_new_tokens
    assert _chat_text(server, max_tokens=3)[1] == 3  # the request wins
    assert _chat_text(server, max_completion_tokens=8)[1] == 8
    completion = dict(prompt="Once upon a time", ignore_eos=True)
    # completions: max_tokens defaults to 16 (OpenAI's and vLLM's); an explicit null takes the
    # model's default
    assert _post(server, "completions", **completion)["usage"]["completion_tokens"] == 16
    null = _post(server, "completions", max_tokens=None, **completion)
    assert null["usage"]["completion_tokens"] == 5
    wait_until_idle(server)


def test_temperature_default_is_greedy_and_an_explicit_one_wins(server: RunningServer) -> None:
    greedy, _ = _chat_text(server, temperature=0.0)
    # unset temperature: the model's 0.0, so the seed changes nothing
    assert {_chat_text(server, seed=s)[0] for s in (1, 2, 3)} == {greedy}
    # an explicit temperature samples (top_k stays the model's 7): some seed leaves greedy
    sampled = {_chat_text(server, temperature=1.0, seed=s)[0] for s in (1, 2, 3)}
    assert sampled - {greedy}
    wait_until_idle(server)
