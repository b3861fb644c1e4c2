"""LoRA adapters through the OpenAI server: chosen by the `model` field, listed in /v1/models
with their base as parent, loaded and unloaded at run time (vLLM's routes, behind vLLM's
environment variable); the tokens and logprobs are transformers+peft's (tests/fixtures/lora)."""

from __future__ import annotations

import argparse
import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from jaxengine.cli import build_parser, run_serve
from jaxengine.server.app import _load_lora_modules
from jaxengine.server.args import LoRAModulePath, parse_lora_module, runtime_lora_updating
from jaxengine.server.models import ServedModels
from tests.jaxengine.server.test_harness import MODEL_NAME, RunningServer, start_server

LORA = Path(__file__).resolve().parents[2] / "fixtures" / "lora"
BASE = LORA.parent / "tiny" / "llama3_gqa"
ADAPTERS = LORA / "llama3_gqa"


@pytest.mark.parametrize("text, module", [
    ("sql=/a/b", LoRAModulePath(name="sql", path="/a/b")),
    ('{"name": "sql", "path": "/a/b", "base_model_name": "m"}',
     LoRAModulePath(name="sql", path="/a/b", base_model_name="m")),
])
def test_lora_modules_in_both_of_vllms_forms(text: str, module: LoRAModulePath) -> None:
    assert parse_lora_module(text) == module


@pytest.mark.parametrize("text, message", [
    ("sql", "want name=path or a JSON object"),
    ('{"name": "sql"}', "path must be a non-empty string"),
    ('{"name": "sql", "path": "/a", "rank": 8}', "unknown field 'rank'"),
    ("=/a/b", "name must be a non-empty string"),
])
def test_bad_lora_modules_are_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_lora_module(text)


def test_lora_modules_need_enable_lora(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    ns = parser.parse_args(["serve", str(BASE), "--lora-modules", f"a={ADAPTERS / 'all7'}"])
    with pytest.raises(SystemExit):
        run_serve(ns, parser)
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
    ns = parser.parse_args(["serve", "--enable-lora", "--lora-modules", "a=/x", '{"name": "b", '
                            '"path": "/y"}'])
    assert isinstance(ns, argparse.Namespace) and [m.name for m in ns.lora_modules] == ["a", "b"]


def test_an_adapter_that_does_not_load_stops_the_start() -> None:
    # LoRA off: refused before the engine is asked (which this test has none of)
    models = ServedModels(None, MODEL_NAME, enable_lora=False)  # type: ignore[arg-type]
    module = LoRAModulePath(name="sql", path=str(ADAPTERS / "all7"))
    with pytest.raises(ValueError, match=r"--lora-modules sql=.*all7: LoRA adapters are not "
                                         r"enabled on this server; start it with --enable-lora"):
        asyncio.run(_load_lora_modules(models, [module]))


@pytest.mark.parametrize("environ, allowed", [
    ({}, False), ({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"}, False),
    ({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}, True),
    ({"JAXENGINE_ALLOW_RUNTIME_LORA_UPDATING": "1"}, True),
])
def test_runtime_updates_follow_vllms_variable(environ: dict, allowed: bool) -> None:
    assert runtime_lora_updating(environ) is allowed


@pytest.fixture(scope="module")
def lora_server() -> RunningServer:
    modules = [LoRAModulePath(name="all7", path=str(ADAPTERS / "all7")),
               LoRAModulePath(name="mlp", path=str(ADAPTERS / "mlp"), base_model_name="other")]
    server = start_server(model=str(BASE), enable_lora=True, max_loras=1, max_lora_rank=8,
                          max_num_batched_tokens=16, max_num_seqs=4,
                          app_args=dict(lora_modules=modules, runtime_lora_updating=True))
    yield server
    server.stop()


def _complete(server: RunningServer, model: str, oracle: Path) -> httpx.Response:
    """A greedy completion of the fixture's prompt ids by `model`, ids and logprobs back."""
    ids = np.load(oracle)["input_ids"].tolist()
    body = {"model": model, "prompt": ids, "max_tokens": 12, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, trust_env=False,
                      timeout=120)


def _assert_oracle(r: httpx.Response, oracle: Path, model: str) -> None:
    assert r.status_code == 200, r.text
    expected = np.load(oracle)
    assert r.json()["model"] == model
    logprobs = r.json()["choices"][0]["logprobs"]
    assert [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]] == expected[
        "greedy_ids"].tolist()
    np.testing.assert_allclose(logprobs["token_logprobs"], expected["greedy_logprobs"],
                               atol=2e-3, rtol=0)


def _post(server: RunningServer, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{route}", json=body, trust_env=False, timeout=120)


def test_models_lists_adapters_with_their_parent(lora_server: RunningServer) -> None:
    cards = httpx.get(f"{lora_server.base_url}/v1/models", trust_env=False).json()["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        (MODEL_NAME, None, MODEL_NAME), ("all7", MODEL_NAME, str(ADAPTERS / "all7")),
        ("mlp", "other", str(ADAPTERS / "mlp"))]


def test_the_model_field_picks_the_adapter(lora_server: RunningServer) -> None:
    # One at a time: the engine's own test mixes adapters in a step (max_loras=1 there too),
    # and a request alone runs in the token buckets of 16 and 1 only (fewer compilations).
    for model, oracle in [(MODEL_NAME, LORA / "llama3_gqa" / "oracle.npz"),
                          ("all7", ADAPTERS / "all7" / "oracle.npz"),
                          ("mlp", ADAPTERS / "mlp" / "oracle.npz")]:
        _assert_oracle(_complete(lora_server, model, oracle), oracle, model)
    r = _complete(lora_server, "nope", ADAPTERS / "all7" / "oracle.npz")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "NotFoundError" and r.json()["error"]["param"] == "model"
    assert "The model `nope` does not exist" in r.json()["error"]["message"]


@pytest.mark.slow  # the mixed steps compile more token buckets
def test_the_base_and_adapters_at_once_with_one_slot(lora_server: RunningServer) -> None:
    cases = [(MODEL_NAME, LORA / "llama3_gqa" / "oracle.npz"),
             ("all7", ADAPTERS / "all7" / "oracle.npz"), ("mlp", ADAPTERS / "mlp" / "oracle.npz")]
    with ThreadPoolExecutor(len(cases)) as pool:
        responses = list(pool.map(lambda case: _complete(lora_server, *case), cases))
    for (model, oracle), r in zip(cases, responses, strict=True):
        _assert_oracle(r, oracle, model)


def test_chat_by_adapter_name(lora_server: RunningServer) -> None:
    # 33 prompt tokens (one a character): chunks of 16, 16 and 1, the buckets compiled already
    messages = [{"role": "user", "content": "Hi there, you!"}]
    ids = _post(lora_server, "/tokenize", {"model": "all7", "messages": messages}).json()["tokens"]
    chat = _post(lora_server, "/v1/chat/completions", {
        "model": "all7", "messages": messages, "max_tokens": 6, "temperature": 0.0,
        "ignore_eos": True}).json()
    completion = _post(lora_server, "/v1/completions", {
        "model": "all7", "prompt": ids, "max_tokens": 6, "temperature": 0.0,
        "ignore_eos": True}).json()
    base = _post(lora_server, "/v1/completions", {
        "model": MODEL_NAME, "prompt": ids, "max_tokens": 6, "temperature": 0.0,
        "ignore_eos": True}).json()
    assert len(ids) == 33 and chat["model"] == "all7"
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    assert completion["choices"][0]["text"] != base["choices"][0]["text"]


def test_load_and_unload_at_run_time(lora_server: RunningServer, tmp_path: Path) -> None:
    load = {"lora_name": "rs", "lora_path": str(ADAPTERS / "attn_rs")}
    r = _post(lora_server, "/v1/load_lora_adapter", load)
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'rs' added successfully.")
    _assert_oracle(_complete(lora_server, "rs", ADAPTERS / "attn_rs" / "oracle.npz"),
                   ADAPTERS / "attn_rs" / "oracle.npz", "rs")
    r = _post(lora_server, "/v1/load_lora_adapter", load)
    assert r.status_code == 400 and "has already been loaded" in r.json()["error"]["message"]
    # an adapter of another base, and a path that is not there: refused, nothing changes
    other = {"lora_name": "gemma", "lora_path": str(LORA / "gemma3_text" / "all7")}
    r = _post(lora_server, "/v1/load_lora_adapter", other)
    assert r.status_code == 400 and "another base model" in r.json()["error"]["message"]
    r = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "x",
                                                     "lora_path": str(tmp_path / "none")})
    assert r.status_code == 404 and "No adapter found" in r.json()["error"]["message"]
    assert _complete(lora_server, "gemma", ADAPTERS / "all7" / "oracle.npz").status_code == 404
    r = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "rs", "lora_int_id": 99})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_int_id"
    r = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "rs"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'rs' removed successfully.")
    assert _complete(lora_server, "rs", ADAPTERS / "all7" / "oracle.npz").status_code == 404
    r = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "rs"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
    _assert_oracle(_complete(lora_server, "all7", ADAPTERS / "all7" / "oracle.npz"),
                   ADAPTERS / "all7" / "oracle.npz", "all7")  # still serving


def test_runtime_updates_off_is_vllms_404(lora_server: RunningServer) -> None:
    models = lora_server.app.state.models
    models.runtime_updates = False
    try:
        load = {"lora_name": "a", "lora_path": str(ADAPTERS / "mlp")}
        for route, body in (("/v1/load_lora_adapter", load),
                            ("/v1/unload_lora_adapter", {"lora_name": "mlp"})):
            r = _post(lora_server, route, body)
            assert r.status_code == 404, route
            assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in r.json()["error"]["message"]
    finally:
        models.runtime_updates = True
