"""Prompt logprobs through the real server with the official `openai` client: vLLM's
`prompt_logprobs` field (completions: on each choice; chat: on the response), completions'
`echo` with `logprobs` (the prompt's tokens lead `choices[].logprobs`, the first entry null)
and `echo` with `max_tokens: 0` (the prompt alone), whole and streamed. Values are checked
against `jaxengine.score` on the server's own model; a chunked-prefill server and a prefix-cached
prompt give the same ones."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import jax.numpy as jnp
import numpy as np
import openai
import pytest

from jaxengine.fixed_batch.score import score
from tests.jaxengine.server.test_harness import (
    MODEL_NAME,
    RunningServer,
    start_server,
    wait_until_idle,
)

GREEDY: dict[str, Any] = {"model": MODEL_NAME, "temperature": 0.0}
PROMPT = [int(t) for t in np.random.default_rng(3).integers(5, 90, 23)]


def _reference(server: RunningServer, prompt: list[int]) -> np.ndarray:
    """Each prompt token's logprob given the ones before, from one jitted forward pass."""
    model = server.engine.runner.model
    out = score(model, jnp.asarray([prompt[:1]]), jnp.asarray([prompt[1:]]))
    return np.asarray(out.logprobs[0])


def _values(prompt_logprobs: list, prompt: list[int]) -> np.ndarray:
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    return np.array([e[str(t)]["logprob"] for e, t in zip(prompt_logprobs[1:], prompt[1:],
                                                           strict=True)])


def test_completions_prompt_logprobs_are_the_models(client: openai.OpenAI,
                                                    server: RunningServer) -> None:
    out = client.completions.create(prompt=PROMPT, max_tokens=2, **GREEDY,
                                    extra_body={"prompt_logprobs": 3})
    plp = out.choices[0].model_extra["prompt_logprobs"]
    np.testing.assert_allclose(_values(plp, PROMPT), _reference(server, PROMPT), atol=1e-4)
    for entry, token in zip(plp[1:], PROMPT[1:], strict=True):
        ranks = sorted(v["rank"] for v in entry.values())
        assert ranks[:3] == [1, 2, 3] and len(entry) in (3, 4)  # top 3 (+ the prompt token)
        assert entry[str(token)]["decoded_token"] is not None
    plain = client.completions.create(prompt=PROMPT, max_tokens=2, **GREEDY)
    assert "prompt_logprobs" not in (plain.choices[0].model_extra or {})
    assert out.choices[0].text == plain.choices[0].text
    wait_until_idle(server)


def test_a_prefix_cached_prompt_still_gets_all_its_prompt_logprobs(
        client: openai.OpenAI, server: RunningServer) -> None:
    prompt = [int(t) for t in np.random.default_rng(4).integers(5, 90, 30)]
    client.completions.create(prompt=prompt, max_tokens=1, **GREEDY)  # caches its 7 blocks
    again = client.completions.create(prompt=prompt, max_tokens=1, **GREEDY)
    assert server.engine.snapshot().stats.prefix_cache_hits > 0
    asked = client.completions.create(prompt=prompt, max_tokens=1, **GREEDY,
                                      extra_body={"prompt_logprobs": 0})
    plp = asked.choices[0].model_extra["prompt_logprobs"]
    np.testing.assert_allclose(_values(plp, prompt), _reference(server, prompt), atol=1e-4)
    assert all(len(e) == 1 for e in plp[1:])  # 0 top: the prompt token alone
    assert asked.choices[0].text == again.choices[0].text
    wait_until_idle(server)


def test_echo_with_logprobs_leads_with_the_prompts_tokens(client: openai.OpenAI,
                                                          server: RunningServer) -> None:
    out = client.completions.create(prompt=PROMPT, max_tokens=3, echo=True, logprobs=2,
                                    **GREEDY)
    lp, n = out.choices[0].logprobs, len(PROMPT)
    assert len(lp.tokens) == n + 3 == out.usage.prompt_tokens + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:n], _reference(server, PROMPT), atol=1e-4)
    assert all(len(t) in (2, 3) for t in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(n + 3)]
    plain = client.completions.create(prompt=PROMPT, max_tokens=3, logprobs=2, **GREEDY)
    # The echoed request attends its prompt whole (prompt logprobs read no prefix cache), the
    # plain one the prompt's uncached tail as a decode: the same bits only where the head dim
    # (8) is under the CPU kernel's vector width, as with AVX-512 and not AVX2 or SSE
    # (tests/jaxengine_kernels/test_cpu_kernel.py); float32 rounding apart elsewhere.
    assert lp.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs,
                                                  rel=0, abs=1e-5)
    assert out.choices[0].text.endswith(plain.choices[0].text)
    # Streamed (vLLM): the first chunk carries the prompt's text and logprobs, then the rest.
    chunks = list(client.completions.create(prompt=PROMPT, max_tokens=3, echo=True,
                                            logprobs=2, stream=True, **GREEDY))
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None and len(first.tokens) >= n + 1
    tokens = [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens
    assert [x for c in chunks if c.choices for x in c.choices[0].logprobs.text_offset] == \
        lp.text_offset
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    wait_until_idle(server)


def test_echo_caps_the_prompts_top_lists_at_logprobs_plus_one(client: openai.OpenAI,
                                                              server: RunningServer) -> None:
    # A larger prompt_logprobs fills the prompt_logprobs field, not the echoed top lists (vLLM).
    out = client.completions.create(prompt=PROMPT, max_tokens=1, echo=True, logprobs=1,
                                    **GREEDY, extra_body={"prompt_logprobs": 4})
    choice, n = out.choices[0], len(PROMPT)
    assert all(len(e) in (4, 5) for e in choice.model_extra["prompt_logprobs"][1:])
    tops = choice.logprobs.top_logprobs[1:n]
    assert all(len(t) in (1, 2) for t in tops)
    assert any(len(t) == 2 for t in tops)  # a prompt token that is not the best one
    wait_until_idle(server)


def test_echo_with_max_tokens_0_returns_the_prompt_alone(client: openai.OpenAI,
                                                         server: RunningServer) -> None:
    text = "the cat sat"
    out = client.completions.create(prompt=text, max_tokens=0, echo=True, **GREEDY)
    assert out.choices[0].text == text and out.choices[0].logprobs is None
    # vLLM generates one token, shows none and counts it
    assert out.usage.completion_tokens == 1 and out.choices[0].finish_reason == "length"
    with_lp = client.completions.create(prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                        **GREEDY)
    lp = with_lp.choices[0].logprobs
    assert len(lp.tokens) == len(PROMPT) == with_lp.usage.prompt_tokens
    assert lp.token_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], _reference(server, PROMPT), atol=1e-4)
    streamed = list(client.completions.create(prompt=text, max_tokens=0, echo=True,
                                              stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text
    with pytest.raises(openai.BadRequestError) as info:  # without echo, 0 is refused
        client.completions.create(prompt=text, max_tokens=0, **GREEDY)
    assert info.value.body["param"] == "max_tokens"
    wait_until_idle(server)


def test_chat_prompt_logprobs_are_on_the_response(client: openai.OpenAI,
                                                  server: RunningServer) -> None:
    messages = [{"role": "user", "content": "name a colour"}]
    out = client.chat.completions.create(messages=messages, max_tokens=2, **GREEDY,
                                         extra_body={"prompt_logprobs": 1})
    plp = out.model_extra["prompt_logprobs"]
    ids = httpx.post(f"{server.base_url}/tokenize", trust_env=False, timeout=60, json={
        "messages": messages, "add_generation_prompt": True}).json()["tokens"]
    assert len(plp) == len(ids) == out.usage.prompt_tokens
    np.testing.assert_allclose(_values(plp, ids), _reference(server, ids), atol=1e-4)
    wait_until_idle(server)


@pytest.mark.parametrize(("body", "message"), [
    ({"prompt_logprobs": 2, "stream": True}, "not available when `stream=True`"),
    ({"prompt_logprobs": -1}, ">= 0"),
    ({"prompt_logprobs": 21}, "max_logprobs=20"),
])
def test_bad_prompt_logprobs_are_a_400_naming_the_field(client: openai.OpenAI,
                                                        server: RunningServer,
                                                        body: dict, message: str) -> None:
    stream = body.pop("stream", False)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(prompt="x", max_tokens=2, stream=stream, **GREEDY,
                                  extra_body=body)
    assert info.value.body["param"] == "prompt_logprobs"
    assert message in info.value.body["message"]
    wait_until_idle(server)


@pytest.fixture(scope="module")
def chunked() -> Iterator[RunningServer]:
    running = start_server(max_num_batched_tokens=8, max_num_seqs=4)
    yield running
    running.stop()


def test_chunked_prefill_gives_the_same_prompt_logprobs(client: openai.OpenAI,
                                                        chunked: RunningServer) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0.0,
            "prompt_logprobs": 2}
    whole = client.completions.create(**{k: v for k, v in body.items() if k != "prompt_logprobs"},
                                      extra_body={"prompt_logprobs": 2})
    parts = httpx.post(f"{chunked.base_url}/v1/completions", json=body, timeout=120,
                       trust_env=False).json()
    a = whole.choices[0].model_extra["prompt_logprobs"]
    b = parts["choices"][0]["prompt_logprobs"]
    assert len(a) == len(b) == len(PROMPT)
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x.keys() == y.keys()
        for t in x:
            assert x[t]["rank"] == y[t]["rank"]
            assert x[t]["logprob"] == pytest.approx(y[t]["logprob"], abs=1e-4)
    assert whole.choices[0].text == parts["choices"][0]["text"]
    wait_until_idle(chunked)
