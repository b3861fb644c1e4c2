"""From process start to the first generated tokens: `LLM()` on the default model, then one
8-token greedy `generate`, each run in a fresh Python process.

Each run reports, in seconds since its process started: importing `jaxengine`, `LLM()` (of it,
the precompile: the programs a first short request needs, each loaded whole from the
compilation cache, or traced and compiled or read from JAX's persistent cache), the
`generate`, and when the programs `LLM()` left to a background thread were all ready. "cold"
runs start with an empty compilation cache of their own; "warm" runs share one that a first,
unreported run fills. The CPU kernels' build cache (`$XDG_CACHE_HOME/jaxengine/native`) is left
as it is: build it once beforehand.

    PYTHONPATH=. python benchmarks/startup.py [--runs 2] [--cold 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PROMPT = "Hello, my name is"


def _child(cache_dir: str) -> None:
    """One measured start, its phases printed as JSON on the last line of stdout."""
    with open("/proc/self/stat") as f:  # the process's start, in clock ticks since boot
        started_ticks = float(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        boot = next(float(line.split()[1]) for line in f if line.startswith("btime"))
    start = boot + started_ticks / os.sysconf("SC_CLK_TCK")
    import jaxengine

    t_import = time.time()
    llm = jaxengine.LLM(compilation_cache_dir=cache_dir)
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


def _run(cache_dir: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run([sys.executable, __file__, "--child", cache_dir], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2, help="warm runs")
    ap.add_argument("--cold", type=int, default=1, help="cold runs")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return _child(args.child)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as warm_dir:
        _run(warm_dir)  # fills the warm cache
        cases = [("cold", None)] * args.cold + [("warm", warm_dir)] * args.runs
        for name, cache in cases:
            with tempfile.TemporaryDirectory() as cold_dir:
                r = _run(cache or cold_dir)
            print(f"{name}: " + "  ".join(f"{k} {v:.2f} s" for k, v in r.items()
                                          if isinstance(v, float)) + f"  {r['text']!r}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
