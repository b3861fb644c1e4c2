"""The OpenAI endpoints through the official `openai` client against a real server."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.jaxengine.server.test_harness import (
    MODEL_NAME,
    RunningServer,
    wait_until_idle,
)


def test_health_and_models(server: RunningServer, client: openai.OpenAI) -> None:
    assert httpx.get(f"{server.base_url}/health", trust_env=False, timeout=10).status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_completion_returns_max_tokens_and_usage(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=7,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert out.object == "text_completion" and out.model == MODEL_NAME
    assert choice.finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 7
    assert out.usage.prompt_tokens > 0 and choice.text


def test_chat_uses_the_template_and_greedy_is_repeatable(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]

    def ask() -> str:
        out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6,
                                             temperature=0.0, extra_body={"ignore_eos": True})
        assert out.object == "chat.completion"
        assert out.choices[0].message.role == "assistant"
        assert out.usage is not None and out.usage.completion_tokens == 6
        return out.choices[0].message.content or ""

    assert ask() == ask()


def test_same_seed_same_text(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        out = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=12,
                                        temperature=1.0, top_p=0.9, seed=seed,
                                        extra_body={"ignore_eos": True, "top_k": 50})
        return out.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL_NAME, prompt="the cat", max_tokens=24, temperature=0.0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = next((full[i:i + 2] for i in range(2, len(full) - 1) if full[i:i + 2].strip()), None)
    assert stop is not None, f"no usable stop string in {full!r}"
    out = client.completions.create(**kw, stop=[stop]).choices[0]
    assert out.finish_reason == "stop"
    assert out.text == full[:full.index(stop)]


def test_streaming_completion_arrives_in_chunks(client: openai.OpenAI) -> None:
    stream = client.completions.create(model=MODEL_NAME, prompt="stream me", max_tokens=10,
                                       temperature=0.0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    arrivals, texts, finish, usage = [], [], None, None
    for chunk in stream:
        arrivals.append(time.monotonic())
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts.append(choice.text)
            finish = choice.finish_reason or finish
    assert len(arrivals) >= 2 and arrivals[0] < arrivals[-1]
    assert finish == "length" and usage is not None and usage.completion_tokens == 10
    whole = client.completions.create(model=MODEL_NAME, prompt="stream me", max_tokens=10,
                                      temperature=0.0, extra_body={"ignore_eos": True})
    assert "".join(texts) == whole.choices[0].text


def test_streaming_chat_deltas_add_up(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "count"}]
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8,
                                            temperature=0.0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert len(chunks) >= 3
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8,
                                           temperature=0.0, extra_body={"ignore_eos": True})
    assert text == whole.choices[0].message.content


def test_logprobs_in_both_endpoints(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=4,
                                    temperature=0.0, logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == 4 and len(lp.token_logprobs) == 4
    assert all(len(top) <= 3 for top in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs)
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=3, temperature=0.0,
                                          messages=[{"role": "user", "content": "hi"}],
                                          logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    # greedy: the sampled token is the most likely one
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


def test_token_id_prompt_and_priority(client: openai.OpenAI, server: RunningServer) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=3,
                                    extra_body={"ignore_eos": True, "priority": 3})
    assert out.usage is not None and out.usage.prompt_tokens == 4
    wait_until_idle(server)


def test_metrics_endpoint_has_vllm_names(server: RunningServer, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL_NAME, prompt="metrics", max_tokens=2,
                              extra_body={"ignore_eos": True})
    text = httpx.get(f"{server.base_url}/metrics", trust_env=False, timeout=10).text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "request_success_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket",
                 "request_time_per_output_token_seconds_bucket",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_sum",
                 "iteration_tokens_total_bucket"):
        assert f"jaxengine:{name}" in text, name
    assert 'finished_reason="length"' in text
