"""Several choices per request (n, a list of prompts) and what shapes a choice's text (echo,
include_stop_str_in_output, continue_final_message, truncate_prompt_tokens), through the real
server with the official `openai` client."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai

from tests.jaxengine.server.test_harness import (
    MODEL_NAME,
    RunningServer,
    wait_until_idle,
)

GREEDY: dict[str, Any] = {"model": MODEL_NAME, "temperature": 0.0,
                          "extra_body": {"ignore_eos": True}}
SAMPLED: dict[str, Any] = {"model": MODEL_NAME, "temperature": 1.0,
                           "extra_body": {"ignore_eos": True}}


def _texts(out: Any) -> list[str]:
    assert [c.index for c in out.choices] == list(range(len(out.choices)))
    return [c.text for c in out.choices]


def test_a_list_of_prompts_gives_one_choice_per_prompt(client: openai.OpenAI) -> None:
    prompts = ["the cat sat", "a dog ran far", "hello"]
    batch = client.completions.create(prompt=prompts, max_tokens=5, **GREEDY)
    alone = [client.completions.create(prompt=p, max_tokens=5, **GREEDY) for p in prompts]
    assert _texts(batch) == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 15
    ids = [[5, 6, 7, 8], [9, 10]]
    by_ids = client.completions.create(prompt=ids, max_tokens=3, **GREEDY)
    assert len(by_ids.choices) == 2 and by_ids.usage.prompt_tokens == 6
    single = client.completions.create(prompt=ids[1], max_tokens=3, **GREEDY)
    assert by_ids.choices[1].text == single.choices[0].text


def test_n_seeded_samples_differ_and_are_reproducible(client: openai.OpenAI,
                                                      server: RunningServer) -> None:
    kw = dict(prompt="once upon a time", max_tokens=12, seed=7, **SAMPLED)
    first = _texts(client.completions.create(n=3, **kw))
    assert len(first) == 3 and len(set(first)) == 3, first
    assert _texts(client.completions.create(n=3, **kw)) == first
    # vLLM V1's rule: sample i is the request with seed + i
    assert [client.completions.create(**{**kw, "seed": 7 + i}).choices[0].text
            for i in range(3)] == first
    out = client.completions.create(n=2, best_of=2, **{**kw, "seed": None})
    assert len(out.choices) == 2 and out.usage.completion_tokens == 24
    wait_until_idle(server)


def test_n_with_a_list_of_prompts_orders_choices_by_prompt(client: openai.OpenAI) -> None:
    out = client.completions.create(prompt=["red", "green blue"], n=2, max_tokens=4, seed=3,
                                    **SAMPLED)
    texts = _texts(out)
    assert len(texts) == 4
    for p, prompt in enumerate(["red", "green blue"]):
        for i in range(2):
            alone = client.completions.create(prompt=prompt, max_tokens=4, seed=3 + i,
                                              **SAMPLED)
            assert texts[p * 2 + i] == alone.choices[0].text
    assert out.usage.completion_tokens == 16


def test_n_samples_share_the_prompts_prefix_cache(server: RunningServer) -> None:
    # 33 tokens: 8 full blocks of 4. Sample 0 computes them; samples 1-3, admitted in the same
    # step, hit all 8 (vLLM caches a block when it is allocated).
    prompt = list(range(40, 73))
    hits = _prefix_hits(server)
    r = httpx.post(f"{server.base_url}/v1/completions", trust_env=False, timeout=120,
                   json={"model": MODEL_NAME, "prompt": prompt, "n": 4, "max_tokens": 2,
                         "ignore_eos": True, "temperature": 1.0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4
    assert _prefix_hits(server) - hits >= 3 * 32


def _prefix_hits(server: RunningServer) -> float:
    text = httpx.get(f"{server.base_url}/metrics", trust_env=False, timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("jaxengine:prefix_cache_hits_total"))
    return float(line.rsplit(" ", 1)[1])


def test_streamed_n_choices_add_up_to_the_whole_ones(client: openai.OpenAI) -> None:
    kw = dict(prompt="stream several", max_tokens=6, n=2, seed=11, **SAMPLED)
    whole = _texts(client.completions.create(**kw))
    parts: dict[int, str] = {0: "", 1: ""}
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True},
                                           **kw):
        usage = chunk.usage or usage
        for c in chunk.choices:
            parts[c.index] += c.text
    assert [parts[0], parts[1]] == whole
    assert usage is not None and usage.completion_tokens == 12
    chat = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                n=2, seed=5, temperature=1.0, extra_body={"ignore_eos": True})
    whole_chat = client.chat.completions.create(**chat)
    assert [c.index for c in whole_chat.choices] == [0, 1]
    deltas: dict[int, str] = {0: "", 1: ""}
    roles = set()
    for chunk in client.chat.completions.create(stream=True, **chat):
        for c in chunk.choices:
            deltas[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.add(c.index)
    assert roles == {0, 1}
    assert [deltas[0], deltas[1]] == [c.message.content for c in whole_chat.choices]


def test_completion_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    plain = client.completions.create(prompt="the cat", max_tokens=4, **GREEDY)
    echoed = client.completions.create(prompt="the cat", max_tokens=4, echo=True, **GREEDY)
    assert echoed.choices[0].text == "the cat" + plain.choices[0].text
    assert echoed.usage.completion_tokens == 4
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        prompt="the cat", max_tokens=4, echo=True, stream=True, **GREEDY))
    assert streamed == echoed.choices[0].text
    ids = client.completions.create(prompt=[5, 6, 7], max_tokens=2, echo=True, **GREEDY)
    no_echo = client.completions.create(prompt=[5, 6, 7], max_tokens=2, **GREEDY)
    text = ids.choices[0].text
    assert text.endswith(no_echo.choices[0].text) and len(text) > len(no_echo.choices[0].text)


def test_chat_echo_prepends_the_assistants_last_message(client: openai.OpenAI) -> None:
    start = [{"role": "user", "content": "tell me"},
             {"role": "assistant", "content": "Once upon"}]
    kw = dict(model=MODEL_NAME, max_tokens=4, temperature=0.0,
              extra_body={"ignore_eos": True, "continue_final_message": True,
                          "add_generation_prompt": False})
    plain = client.chat.completions.create(messages=start, **kw).choices[0].message.content
    echo_kw = {**kw, "extra_body": {**kw["extra_body"], "echo": True}}
    echoed = client.chat.completions.create(messages=start, **echo_kw)
    assert echoed.choices[0].message.content == "Once upon" + plain
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        messages=start, stream=True, **echo_kw))
    assert streamed == "Once upon" + plain
    user_last = client.chat.completions.create(
        messages=start[:1], model=MODEL_NAME, max_tokens=3, temperature=0.0,
        extra_body={"ignore_eos": True, "echo": True})
    plain_user = client.chat.completions.create(
        messages=start[:1], model=MODEL_NAME, max_tokens=3, temperature=0.0,
        extra_body={"ignore_eos": True})
    assert user_last.choices[0].message.content == plain_user.choices[0].message.content


def test_continue_final_message_leaves_the_last_message_open(server: RunningServer) -> None:
    base = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "Hello the"}]}
    with httpx.Client(base_url=server.base_url, trust_env=False, timeout=60) as http:
        open_ = http.post("/tokenize", json={**base, "continue_final_message": True,
                                             "add_generation_prompt": False}).json()
        closed = http.post("/tokenize", json={**base, "add_generation_prompt": False}).json()
        text = http.post("/detokenize", json={"tokens": open_["tokens"]}).json()["prompt"]
        assert text.endswith("Hello the")  # no end-of-turn after it
        assert closed["tokens"][:open_["count"]] == open_["tokens"]
        assert closed["count"] > open_["count"]
        # add_generation_prompt left out means false here; set true too, it is vLLM's 400
        assert http.post("/tokenize", json={**base, "continue_final_message": True}
                         ).status_code == 200
        both = http.post("/v1/chat/completions", json={
            **base, "continue_final_message": True, "add_generation_prompt": True})
        assert both.status_code == 400 and both.json()["error"]["param"] == \
            "continue_final_message"
        user_last = http.post("/v1/chat/completions", json={
            **base, "messages": base["messages"][:1], "continue_final_message": True})
        assert user_last.status_code == 400


def test_include_stop_str_in_output_keeps_the_stop_string(client: openai.OpenAI) -> None:
    kw = dict(prompt="the cat", max_tokens=24, **GREEDY)
    full = client.completions.create(**kw).choices[0].text
    stop = next((full[i:i + 2] for i in range(2, len(full) - 1) if full[i:i + 2].strip()), None)
    assert stop is not None, f"no usable stop string in {full!r}"
    cut = full.index(stop)
    kept = client.completions.create(
        **{**kw, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}},
        stop=[stop]).choices[0]
    assert kept.finish_reason == "stop" and kept.stop_reason == stop
    assert kept.text == full[:cut + len(stop)]
    dropped = client.completions.create(**kw, stop=[stop]).choices[0]
    assert dropped.text == full[:cut]


def test_truncate_prompt_tokens_keeps_the_last_tokens(client: openai.OpenAI) -> None:
    ids = list(range(20, 36))
    out = client.completions.create(prompt=ids, max_tokens=4, **{
        **GREEDY, "extra_body": {"ignore_eos": True, "truncate_prompt_tokens": 5}})
    last = client.completions.create(prompt=ids[-5:], max_tokens=4, **GREEDY)
    assert out.usage.prompt_tokens == 5 and out.choices[0].text == last.choices[0].text


def test_request_id_and_tokens_as_ids(client: openai.OpenAI, server: RunningServer) -> None:
    out = client.completions.create(prompt="x", max_tokens=2, logprobs=1, **{
        **GREEDY, "extra_body": {"ignore_eos": True, "request_id": "mine-1",
                                 "return_tokens_as_token_ids": True}})
    assert out.id == "cmpl-mine-1"
    assert all(t.startswith("token_id:") for t in out.choices[0].logprobs.tokens)
    wait_until_idle(server)


def test_continuous_usage_stats_put_the_usage_in_every_chunk(server: RunningServer) -> None:
    body = {"model": MODEL_NAME, "prompt": "count", "max_tokens": 4, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}
    usages = []
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, trust_env=False,
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usages.append(json.loads(line[6:])["usage"])
    completions = [u["completion_tokens"] for u in usages]
    assert completions == sorted(completions) and completions[-1] == 4
    assert all(u["prompt_tokens"] == usages[0]["prompt_tokens"] > 0 for u in usages)


def test_the_x_request_id_header_names_the_response(server: RunningServer) -> None:
    r = httpx.post(f"{server.base_url}/v1/completions", trust_env=False, timeout=60,
                   headers={"X-Request-Id": "from-header"},
                   json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2,
                         "request_id": "from-body"})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-from-header"


def test_each_choice_has_its_own_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(prompt="abc", n=2, max_tokens=4, logprobs=2, seed=9,
                                    **SAMPLED)
    for choice in out.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == 4 and lp.text_offset[0] == 0  # each choice counts its own
        # The sampled token is in its own top dict, with the 2 best (3 entries when it is not
        # one of them), as OpenAI's legacy completions and vLLM give it.
        assert all(t in top and len(top) <= 3 for t, top in zip(lp.tokens, lp.top_logprobs,
                                                                 strict=True))
        pairs = zip(lp.text_offset[:-1], lp.tokens[:-1], strict=True)
        assert lp.text_offset[1:] == [offset + len(token) for offset, token in pairs]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=3,
        logprobs=True, top_logprobs=1, seed=9, temperature=1.0,
        extra_body={"ignore_eos": True})
    assert [len(c.logprobs.content) for c in chat.choices] == [3, 3]
    # The one best token each time, not also the sampled one when it ranks lower.
    content = [t for c in chat.choices for t in c.logprobs.content]
    assert all(len(t.top_logprobs) == 1 for t in content)
    assert any(t.logprob < t.top_logprobs[0].logprob for t in content)  # some ranked lower


def test_stream_options_sent_include_the_usage_unless_told_not_to(server: RunningServer) -> None:
    def usage_chunks(options: dict[str, Any]) -> int:
        body = {"model": MODEL_NAME, "prompt": "u", "max_tokens": 2, "stream": True,
                "stream_options": options}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                          trust_env=False, timeout=60) as r:
            return sum(1 for line in r.iter_lines() if line.startswith("data: {")
                       and json.loads(line[6:]).get("choices") == [])

    assert usage_chunks({}) == 1  # vLLM's default: include_usage true
    assert usage_chunks({"include_usage": False}) == 0
