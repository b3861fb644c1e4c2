"""1 prefill + 1 decode `jaxengine serve` process behind a `jaxengine proxy` process, on the
tiny model and 127.0.0.1: the answer through the proxy is the decode instance's own, and a
prefill instance killed before the pickup leaves the decode instance recomputing and serving."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.jaxengine.server.test_harness import TINY
from tests.parallel_helpers import REPO

SERVE = [sys.executable, "-m", "jaxengine", "serve", str(TINY), "--served-model-name", "m",
         "--max-model-len", "128", "--max-num-batched-tokens", "64", "--block-size", "4",
         "--max-num-seqs", "4", "--log-interval", "0", "--uvicorn-log-level", "warning"]
BODY = {"model": "m", "prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 6,
        "temperature": 0}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url} exited with {proc.returncode}"
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} did not become healthy")


@pytest.fixture
def deployment() -> Iterator[dict[str, object]]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    ports = {name: _port() for name in ("prefill", "decode", "proxy")}
    commands = {
        "prefill": [*SERVE, "--port", str(ports["prefill"]), "--kv-transfer-config",
                    json.dumps({"kv_role": "kv_producer", "kv_port": 0})],
        "decode": [*SERVE, "--port", str(ports["decode"]), "--kv-transfer-config",
                   json.dumps({"kv_role": "kv_consumer",
                               "kv_connector_extra_config": {"fetch_timeout_s": 10}})],
        "proxy": [sys.executable, "-m", "jaxengine", "proxy", "--port", str(ports["proxy"]),
                  "--prefill", f"http://127.0.0.1:{ports['prefill']}", "--decode",
                  f"http://127.0.0.1:{ports['decode']}", "--uvicorn-log-level", "warning"]}
    procs = {name: subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
             for name, cmd in commands.items()}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    try:
        for name in procs:
            _healthy(urls[name], procs[name])
        yield {"urls": urls, "procs": procs}
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(30)


@pytest.mark.slow  # three processes start and compile: about a minute on 2 vCPUs
def test_processes_behind_the_proxy_answer_as_the_decode_instance_alone(
        deployment: dict) -> None:
    urls, procs = deployment["urls"], deployment["procs"]
    with httpx.Client(trust_env=False, timeout=300) as http:
        via = http.post(urls["proxy"] + "/v1/completions", json=BODY).json()
        # the whole prompt came from the prefill instance (its last token computed again)
        hits = [line for line in http.get(urls["decode"] + "/metrics").text.splitlines()
                if line.startswith("jaxengine:external_prefix_cache_hits_total")]
        assert float(hits[0].split()[-1]) == via["usage"]["prompt_tokens"]
        prefilled = http.post(urls["prefill"] + "/v1/completions", json={
            **BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
        handle = prefilled["kv_transfer_params"]
        assert handle["do_remote_prefill"] and handle["remote_num_tokens"] > 1
        procs["prefill"].kill()  # dies before the pickup: the decode instance recomputes
        procs["prefill"].wait(30)
        lost = http.post(urls["decode"] + "/v1/completions",
                         json={**BODY, "kv_transfer_params": handle}).json()
        alone = http.post(urls["decode"] + "/v1/completions", json=BODY).json()
    assert via["choices"][0]["text"] == lost["choices"][0]["text"] == alone["choices"][0]["text"]
