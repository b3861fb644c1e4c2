"""Prefill/decode disaggregation (docs/BENCHMARKS.md §15): TTFT and TPOT of mixed long- and
short-prompt traffic, 1 prefill + 1 decode instance behind `jaxengine proxy` against two plain
replicas (requests alternated between them), each a `jaxengine serve` process.

    python benchmarks/pd.py [--model PATH] [--num-requests 24] [--long-every 4]
        [--long-chars 2400] [--short-chars 120] [--max-tokens 32] [--interval 0.5] [--json]
        [--serve-args "--max-num-seqs 8 ..."] [--hops]

Request i arrives at i * --interval seconds; every --long-every-th has a long prompt (text of
about --long-chars characters), the others a short one; each prompt starts with its own number,
so no prefix is shared. Every request is greedy, streamed, and asks --max-tokens tokens past
EOS. TTFT is the time to the first streamed chunk, TPOT the time per chunk after it (a chunk
per step: one token). The
two set-ups run one after the other on the same machine (start-up and warm-up excluded); the
servers' flags are --serve-args, the same for every process. With --hops, single requests
are first timed hop by hop on the idle P/D set-up. The default model is the embedded
SmolLM2-135M.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
         "wizards", "quietly", "judge", "boxing", "matches", "near", "old", "river", "bank"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt(i: int, chars: int) -> str:
    """About `chars` characters of text, its own from the first word."""
    text, k = f"Request {i}:", i
    while len(text) < chars:
        text += " " + WORDS[k % len(WORDS)]
        k = k * 7 + 3
    return text


@contextlib.contextmanager
def processes(commands: list[list[str]], log_dir: Path) -> Iterator[None]:
    """Start the commands (logs in `log_dir`), stop them on exit."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = []
    try:
        for n, cmd in enumerate(commands):
            log = open(log_dir / f"{n}.log", "w")  # noqa: SIM115  # closed with its process
            procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True), log))
        yield
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, log in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()


def wait_healthy(urls: list[str], timeout_s: float = 1800) -> None:
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=5, trust_env=False).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not become healthy")
            time.sleep(1)


async def one(client: httpx.AsyncClient, url: str, text: str, start: float, delay: float,
              max_tokens: int) -> dict[str, float]:
    await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
    sent = time.perf_counter()
    times = []
    body = {"model": "m", "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {(await r.aread()).decode()}")
        async for line in r.aiter_lines():
            if (line.startswith("data: ") and line != "data: [DONE]"
                    and json.loads(line[6:])["choices"]):  # a chunk of new tokens
                times.append(time.perf_counter())
    ttft = times[0] - sent
    tpot = (times[-1] - times[0]) / max(1, len(times) - 1)
    return {"ttft": ttft, "tpot": tpot}


async def load(urls: list[str], ns: argparse.Namespace) -> list[dict[str, float]]:
    """The workload, request i to urls[i % len(urls)]."""
    async with httpx.AsyncClient(timeout=3600, trust_env=False) as client:
        start = time.perf_counter()
        jobs = []
        for i in range(ns.num_requests):
            long = i % ns.long_every == 0
            text = prompt(i, ns.long_chars if long else ns.short_chars)
            jobs.append(one(client, urls[i % len(urls)], text, start, i * ns.interval,
                            ns.max_tokens))
        results = await asyncio.gather(*jobs)
    for i, r in enumerate(results):
        r["long"] = float(i % ns.long_every == 0)
    return results


def hops(prefill: str, decode: str, proxy: str, ns: argparse.Namespace
         ) -> dict[str, dict[str, float]]:
    """One short and one long request at a time on the idle P/D set-up, hop by hop (seconds):
    the prefill instance (max_tokens=1), the decode instance given its handle, the decode
    instance alone on a prompt of the same length, the whole way through the proxy."""
    out = {}
    with httpx.Client(trust_env=False, timeout=3600) as http:
        for kind, chars in (("short", ns.short_chars), ("long", ns.long_chars)):
            body = {"model": "m", "max_tokens": ns.max_tokens, "temperature": 0,
                    "ignore_eos": True}
            times = {}
            t0 = time.perf_counter()
            first = http.post(prefill + "/v1/completions", json={
                **body, "prompt": prompt(1000, chars), "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True}}).json()
            times["prefill"] = time.perf_counter() - t0
            for name, url, i, extra in (
                    ("decode given the handle", decode, 1000,
                     {"kv_transfer_params": first["kv_transfer_params"]}),
                    ("decode alone", decode, 1001, {}), ("through the proxy", proxy, 1002, {})):
                t0 = time.perf_counter()
                http.post(url + "/v1/completions",
                          json={**body, "prompt": prompt(i, chars), **extra}).raise_for_status()
                times[name] = time.perf_counter() - t0
            out[f"{kind} ({first['usage']['prompt_tokens']} tokens)"] = times
    return out


def summary(results: list[dict[str, float]]) -> dict[str, float]:
    out = {}
    for kind, flag in (("long", 1.0), ("short", 0.0)):
        rs = [r for r in results if r["long"] == flag]
        for metric in ("ttft", "tpot"):
            values = sorted(r[metric] for r in rs)
            out[f"{kind}_{metric}_p50"] = statistics.median(values)
            out[f"{kind}_{metric}_max"] = values[-1]
    return out


def run(ns: argparse.Namespace) -> dict[str, dict[str, float]]:
    serve = [sys.executable, "-m", "jaxengine", "serve", *([ns.model] if ns.model else []),
             "--served-model-name", "m", "--log-interval", "0", "--uvicorn-log-level",
             "warning", *shlex.split(ns.serve_args)]
    logs = Path(ns.log_dir)
    for name in ("replicas", "pd"):
        (logs / name).mkdir(parents=True, exist_ok=True)
    results = {}
    ports = [free_port() for _ in range(2)]
    with processes([[*serve, "--port", str(p)] for p in ports], logs / "replicas"):
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        wait_healthy(urls)
        results["two replicas"] = summary(asyncio.run(load(urls, ns)))
    prefill, decode, proxy = free_port(), free_port(), free_port()
    commands = [
        [*serve, "--port", str(prefill), "--kv-transfer-config",
         json.dumps({"kv_role": "kv_producer", "kv_port": 0})],
        [*serve, "--port", str(decode), "--kv-transfer-config",
         json.dumps({"kv_role": "kv_consumer"})],
        [sys.executable, "-m", "jaxengine", "proxy", "--port", str(proxy), "--prefill",
         f"http://127.0.0.1:{prefill}", "--decode", f"http://127.0.0.1:{decode}",
         "--uvicorn-log-level", "warning"]]
    with processes(commands, logs / "pd"):
        wait_healthy([f"http://127.0.0.1:{p}" for p in (prefill, decode, proxy)])
        if ns.hops:
            results.update(hops(*(f"http://127.0.0.1:{p}" for p in (prefill, decode, proxy)),
                                ns))
        results["1P+1D"] = summary(asyncio.run(load([f"http://127.0.0.1:{proxy}"], ns)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--long-every", type=int, default=4)
    parser.add_argument("--long-chars", type=int, default=2400)
    parser.add_argument("--short-chars", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--serve-args", default="--max-num-seqs 8 --max-model-len 1024 "
                                                "--max-num-batched-tokens 256")
    parser.add_argument("--log-dir", default="/tmp/jaxengine_pd_bench")
    parser.add_argument("--hops", action="store_true",
                        help="first time single requests on the idle P/D set-up, hop by hop")
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    results = run(ns)
    if ns.json:
        print(json.dumps(results, indent=1))
        return
    for name, r in results.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()))


if __name__ == "__main__":
    main()
