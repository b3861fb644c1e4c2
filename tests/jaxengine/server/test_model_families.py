"""The OpenAI server on the families with sliding windows, soft-caps and experts: a completion
of token ids past the window gives transformers' greedy tokens and their logprobs."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.jaxengine.server.test_harness import MODEL_NAME, TINY, start_server


@pytest.mark.parametrize("name", ["gemma3_text", "qwen2_moe"])
def test_completion_gives_transformers_greedy_tokens(name: str) -> None:
    path = TINY.parent / name
    oracle = np.load(path / "oracle.npz")
    server = start_server(model=str(path), max_num_seqs=4, max_num_batched_tokens=16)
    try:
        body = {"model": MODEL_NAME, "prompt": oracle["input_ids"].tolist(),
                "max_tokens": len(oracle["greedy_ids"]), "temperature": 0.0,
                "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True}
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, trust_env=False,
                       timeout=120)
        assert r.status_code == 200, r.text
        logprobs = r.json()["choices"][0]["logprobs"]
        tokens = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
        assert tokens == oracle["greedy_ids"].tolist()
        np.testing.assert_allclose(logprobs["token_logprobs"], oracle["greedy_logprobs"],
                                   atol=2e-3, rtol=0)
    finally:
        server.stop()
