"""From process start to the first generated tokens: `LLM()` on the default model, then one
8-token greedy `generate`, each run in a fresh Python process; with `--serve`, `jaxengine serve`
on the default model, to `/health` answering 200 and to the first token of a streamed
completion.

Each `LLM()` run reports, in seconds since its process started: importing `jaxengine`, `LLM()`
(of it, the precompile: the programs a first short request needs, each loaded whole from the
compilation cache, or traced and compiled or read from JAX's persistent cache), the `generate`,
and when the programs `LLM()` left to a background thread were all ready. A `--serve` run
reports the seconds from starting the server process to `/health` 200 and to the first
streamed token (each server is stopped once it has made every program). "cold" runs start
with an empty compilation cache and weight cache (jaxengine/loading/weight_cache.py) of their
own; "warm" runs share ones that the first cold run
(or, with `--cold 0`, a first, unreported run) fills. The CPU kernels' build cache
(`$XDG_CACHE_HOME/jaxengine/native`) is left as it is: build it once beforehand.

    PYTHONPATH=. python benchmarks/startup.py [--runs 2] [--cold 1] [--serve]
        [--quantization int8|fp8|gguf]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

PROMPT = "Hello, my name is"
WEIGHT_CACHE_ENV = "JAXENGINE_WEIGHT_CACHE_DIR"  # jaxengine.loading.weight_cache.ENV
ALL_READY = b"background programs done"  # jaxengine.runner.bucket_programs.ALL_READY


def _child(cache_dir: str, quantization: str | None) -> None:
    """One measured start, its phases printed as JSON on the last line of stdout."""
    with open("/proc/self/stat") as f:  # the process's start, in clock ticks since boot
        started_ticks = float(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:  # seconds since boot now (`btime` is whole seconds)
        up = float(f.read().split()[0])
    start = time.time() - (up - started_ticks / os.sysconf("SC_CLK_TCK"))
    import jaxengine

    t_import = time.time()
    llm = jaxengine.LLM(compilation_cache_dir=cache_dir, quantization=quantization)
    t_llm = time.time()
    out = llm.generate([PROMPT], jaxengine.SamplingParams(max_tokens=8, temperature=0),
                       use_tqdm=False)
    t_gen = time.time()
    llm.llm_engine.runner.wait_for_programs()
    print(json.dumps({
        "import": t_import - start, "LLM": t_llm - t_import,
        "precompile": llm.llm_engine.runner.stats.compile_seconds,
        "generate": t_gen - t_llm, "first tokens": t_gen - start,
        "all programs": time.time() - start, "text": out[0].outputs[0].text}))


def _run(caches: tuple[str, str], quantization: str | None) -> dict:
    """One `LLM()` start in a child process with these (compilation, weight) cache dirs."""
    env = {**os.environ, "PYTHONPATH": os.getcwd(), WEIGHT_CACHE_ENV: caches[1]}
    quant = ["--quantization", quantization] if quantization else []
    proc = subprocess.run([sys.executable, __file__, "--child", caches[0], *quant], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_token(base: str) -> str:
    """Stream an 8-token greedy completion until its first token; that token's text."""
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120,
                      trust_env=False) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return json.loads(line[6:])["choices"][0]["text"]
    raise RuntimeError("the stream ended without a token")


def _serve(caches: tuple[str, str], quantization: str | None) -> dict:
    """One `jaxengine serve` start: seconds from the process's start to /health 200 and to
    the first streamed token."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), WEIGHT_CACHE_ENV: caches[1]}
    cmd = [sys.executable, "-m", "jaxengine", "serve", "--port", str(port),
           "--compilation-cache-dir", caches[0], "--served-model-name", "default",
           *(["--quantization", quantization] if quantization else [])]
    with tempfile.TemporaryFile() as log:
        start = time.time()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(log.read().decode()[-3000:])
                try:
                    if httpx.get(f"{base}/health", timeout=2, trust_env=False).status_code \
                            == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
            healthy = time.time()
            text = _first_token(base)
            first = time.time()
            # every program made (and saved) before the stop, which would drop the rest: a
            # later run's caches are then warm for every bucket
            while ALL_READY not in (log.seek(0) or log.read()) and proc.poll() is None:
                time.sleep(0.2)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    return {"health": healthy - start, "first token": first - start, "text": text}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2, help="warm runs")
    ap.add_argument("--cold", type=int, default=1, help="cold runs")
    ap.add_argument("--serve", action="store_true", help="time `jaxengine serve`, not LLM()")
    ap.add_argument("--quantization", help="the weights' quantization= (default: float)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return _child(args.child, args.quantization)

    def run(caches: tuple[str, str]) -> dict:
        return (_serve if args.serve else _run)(caches, args.quantization)

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as warm_jax, tempfile.TemporaryDirectory() as warm_w:
        warm = (warm_jax, warm_w)
        if not args.cold:
            run(warm)  # fills the warm caches
        # the first cold run starts from the warm caches while they are empty, and fills them
        cases = [("cold", warm)] + [("cold", None)] * (args.cold - 1) if args.cold else []
        for name, caches in cases + [("warm", warm)] * args.runs:
            with tempfile.TemporaryDirectory() as cold_jax, \
                    tempfile.TemporaryDirectory() as cold_w:
                r = run(caches or (cold_jax, cold_w))
            print(f"{name}: " + "  ".join(f"{k} {v:.2f} s" for k, v in r.items()
                                          if isinstance(v, float)) + f"  {r['text']!r}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
