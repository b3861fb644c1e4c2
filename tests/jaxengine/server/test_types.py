"""Request fields are strictly typed, as in OpenAI's API: a boolean or string where a number is
expected (and the reverse) is a 400 naming the field, never converted; a JSON integer is still
a number."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.jaxengine.server.test_harness import MODEL_NAME, RunningServer

GOOD = {"v1/completions": {"model": MODEL_NAME, "prompt": "ok", "max_tokens": 2,
                           "ignore_eos": True},
        "v1/chat/completions": {"model": MODEL_NAME, "max_tokens": 2, "ignore_eos": True,
                                "messages": [{"role": "user", "content": "ok"}]},
        "tokenize": {"model": MODEL_NAME, "prompt": "ok"},
        "detokenize": {"model": MODEL_NAME, "tokens": [5, 6]}}
COMPLETIONS, CHAT = "v1/completions", "v1/chat/completions"

# (path, field, a value of the wrong type, what the message says it got)
BAD: list[tuple[str, str, Any, str]] = [
    (COMPLETIONS, "max_tokens", True, "a boolean"),  # ran one token
    (COMPLETIONS, "stream", "yes", "a string"),  # started a stream
    (COMPLETIONS, "n", "2", "a string"),
    (COMPLETIONS, "n", 2.0, "a number"),
    (COMPLETIONS, "temperature", "0.5", "a string"),
    (COMPLETIONS, "temperature", False, "a boolean"),
    (COMPLETIONS, "logprobs", 1.5, "a number"),
    (COMPLETIONS, "logprobs", True, "a boolean"),
    (COMPLETIONS, "stop", 5, "a number"),
    (COMPLETIONS, "seed", "7", "a string"),
    (COMPLETIONS, "echo", 1, "a number"),
    (COMPLETIONS, "ignore_eos", "true", "a string"),
    (COMPLETIONS, "top_k", 5.5, "a number"),
    (COMPLETIONS, "best_of", True, "a boolean"),
    (COMPLETIONS, "min_tokens", False, "a boolean"),
    (COMPLETIONS, "prompt", 7, "a number"),
    (COMPLETIONS, "logit_bias", {"5": "1"}, "a string"),
    (COMPLETIONS, "stop_token_ids", [1, "2"], "a string"),
    (COMPLETIONS, "user", 42, "a number"),
    (CHAT, "logprobs", 1, "a number"),
    (CHAT, "top_logprobs", True, "a boolean"),
    (CHAT, "max_completion_tokens", "10", "a string"),
    (CHAT, "add_generation_prompt", "no", "a string"),
    (CHAT, "messages", [{"role": "user", "content": 5}], "a number"),
    (CHAT, "stream_options", {"include_usage": 1}, "a number"),
    ("tokenize", "add_special_tokens", "yes", "a string"),
    ("detokenize", "tokens", ["5"], "a string"),
]
# JSON integers for number fields, and the usual floats
GOOD_VALUES: list[tuple[str, str, Any]] = [
    (COMPLETIONS, "temperature", 1), (COMPLETIONS, "top_p", 1), (COMPLETIONS, "min_p", 0),
    (COMPLETIONS, "presence_penalty", 0), (COMPLETIONS, "frequency_penalty", 1),
    (COMPLETIONS, "repetition_penalty", 1), (COMPLETIONS, "logit_bias", {"5": 1}),
    (COMPLETIONS, "temperature", 0.5), (CHAT, "temperature", 0), (CHAT, "top_p", 0.9),
    (CHAT, "logprobs", False),
]


def _post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/{path}", json=body, trust_env=False, timeout=60)


@pytest.mark.parametrize(("path", "field", "value", "got"), BAD,
                         ids=[f"{p.split('/')[-1]}-{f}-{v!r}" for p, f, v, _ in BAD])
def test_a_value_of_the_wrong_type_is_a_400_naming_the_field(
        server: RunningServer, path: str, field: str, value: Any, got: str) -> None:
    stream = {"stream": True} if field == "stream_options" else {}
    r = _post(server, path, {**GOOD[path], **stream, field: value})
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")  # no stream began
    error = r.json()["error"]
    assert error["param"] == field, error
    assert error["message"].startswith(f"invalid '{field}") and f"(got {got})" in \
        error["message"], error


@pytest.mark.parametrize(("path", "field", "value"), GOOD_VALUES,
                         ids=[f"{p.split('/')[-1]}-{f}-{v!r}" for p, f, v in GOOD_VALUES])
def test_json_integers_are_numbers(server: RunningServer, path: str, field: str,
                                   value: Any) -> None:
    r = _post(server, path, {**GOOD[path], field: value})
    assert r.status_code == 200, r.text
