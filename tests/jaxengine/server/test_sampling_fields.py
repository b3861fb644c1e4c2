"""The penalty and token-filter fields reach the sampler: each changes the output as vLLM's
would, through the real server with the official `openai` client (greedy on the tiny model)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from jaxengine.server.protocol import CompletionRequest
from tests.jaxengine.server.test_harness import MODEL_NAME, RunningServer

PROMPT = "the cat sat on the mat and the cat"
N = 24


def _ids(client: openai.OpenAI, **extra: Any) -> list[int]:
    """The greedy completion's token ids (logprobs tokens as "token_id:N")."""
    body = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    body.update(extra.pop("extra_body", {}))
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=N,
                                    temperature=0.0, logprobs=0, extra_body=body, **extra)
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]


@pytest.fixture(scope="module")
def greedy(client: openai.OpenAI) -> list[int]:
    ids = _ids(client)
    assert len(set(ids)) < N, "the baseline must repeat itself for the penalties to show"
    return ids


def test_a_strong_logit_bias_forces_its_token(client: openai.OpenAI,
                                              greedy: list[int]) -> None:
    token = next(t for t in range(5, 100) if t not in greedy)
    assert _ids(client, logit_bias={str(token): 100}) == [token] * N
    assert token not in _ids(client, logit_bias={str(greedy[0]): -100})[:1]


@pytest.mark.parametrize("field", ["frequency_penalty", "presence_penalty"])
def test_penalties_reduce_repetition(client: openai.OpenAI, greedy: list[int],
                                     field: str) -> None:
    penalized = _ids(client, **{field: 2.0})
    assert len(set(penalized)) > len(set(greedy)), (greedy, penalized)


def test_repetition_penalty_reduces_repetition(client: openai.OpenAI,
                                               greedy: list[int]) -> None:
    penalized = _ids(client, extra_body={"repetition_penalty": 2.0})
    assert len(set(penalized)) > len(set(greedy)), (greedy, penalized)


def test_allowed_token_ids_limit_the_output(client: openai.OpenAI, greedy: list[int]) -> None:
    allowed = [t for t in range(5, 100) if t not in greedy][:2]
    out = _ids(client, extra_body={"allowed_token_ids": allowed})
    assert set(out) <= set(allowed) and out != greedy


def test_bad_words_are_never_generated(client: openai.OpenAI, server: RunningServer) -> None:
    # The tiny tokenizer is character-level: "N" is one token. A +100 bias makes it every
    # token; banning the word "N" too leaves it out entirely.
    token = server.engine.tokenizer.encode("N", add_special_tokens=False)
    assert len(token) == 1
    forced = {"logit_bias": {str(token[0]): 100}}
    assert _ids(client, **forced) == token * N
    out = _ids(client, **forced, extra_body={"bad_words": ["N"]})
    assert token[0] not in out and len(out) == N


def test_a_logit_bias_key_that_is_not_a_token_id_is_named() -> None:
    from jaxengine.server.protocol import RequestError

    with pytest.raises(RequestError) as info:
        CompletionRequest(prompt="x", logit_bias={"cat": 1.0}).sampling_params(2, None)
    assert info.value.param == "logit_bias"


def test_repetition_penalty_takes_the_models_default_when_unset() -> None:
    defaults = {"repetition_penalty": 1.3}
    assert CompletionRequest(prompt="x").sampling_params(2, None, defaults) \
        .repetition_penalty == 1.3
    assert CompletionRequest(prompt="x", repetition_penalty=1.1) \
        .sampling_params(2, None, defaults).repetition_penalty == 1.1


@pytest.mark.parametrize(("body", "param"), [
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": {"100000": 1.0}}, "logit_bias"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"allowed_token_ids": [100000]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
])
def test_bad_values_are_400s_naming_the_field(server: RunningServer, body: dict[str, Any],
                                              param: str) -> None:
    r = httpx.post(f"{server.base_url}/v1/completions", trust_env=False, timeout=60,
                   json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_kv_transfer_params_reach_the_engine_in_extra_args_with_n_1_and_not_streamed() -> None:
    from jaxengine.server.protocol import RequestError

    handle = {"do_remote_decode": True}
    params = CompletionRequest(prompt="x", kv_transfer_params=handle).sampling_params(2, None)
    assert params.extra_args == {"kv_transfer_params": handle}
    assert CompletionRequest(prompt="x").sampling_params(2, None).extra_args is None
    with pytest.raises(RequestError, match="kv_transfer_params need n=1"):
        CompletionRequest(prompt="x", n=2, kv_transfer_params=handle).check_supported()
    with pytest.raises(RequestError, match="do_remote_decode need stream=false"):
        CompletionRequest(prompt="x", stream=True, kv_transfer_params=handle).check_supported()
