"""Seconds from process start to the first generated token (issue 37's start-up target)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.device_sections.context import Context, report
from jaxengine.loading.load import tiny_model_path

# ---- first token after start ----------------------------------------------------------------

# A fresh interpreter: import, `LLM(model)` (load and precompile), one greedy one-token generate.
FIRST_TOKEN_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from jaxengine import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(sys.argv[1] or None, compilation_cache_dir=sys.argv[2])
t2 = time.perf_counter()
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=1, temperature=0),
                   use_tqdm=False)
t3 = time.perf_counter()
print(json.dumps(dict(imports=t1 - t0, llm=t2 - t1, generate=t3 - t2,
                      tokens=len(out[0].outputs[0].token_ids))))
"""
FIRST_TOKEN_TARGET_S = 5.0  # issue 37: warm cache, process start to the first token


def first_token(ctx: Context) -> list[str]:
    """Seconds from process start to the first generated token, `LLM()` + one short prompt in
    a fresh subprocess: cold (an empty compilation cache) then warm (the cache it filled).
    The default model (the tiny fixture in the CPU smoke); a figure, no threshold."""
    model = (tiny_model_path() or "") if ctx.smoke else ""
    root = str(Path(__file__).resolve().parents[2])  # the repository
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory() as cache:
        for start in ("cold", "warm"):
            t0 = time.perf_counter()
            run = subprocess.run([sys.executable, "-c", FIRST_TOKEN_CHILD, model, cache],
                                 capture_output=True, text=True, env=env, timeout=600)
            wall = time.perf_counter() - t0
            if run.returncode != 0:
                raise RuntimeError(f"{start} start failed: {run.stderr[-2000:]}")
            t = json.loads(run.stdout.strip().splitlines()[-1])
            report("first-token", f"{start}: {wall:.1f} s from process start to "
                    f"{t['tokens']} token (imports {t['imports']:.1f} s, LLM() "
                    f"{t['llm']:.1f} s, generate {t['generate']:.2f} s; target warm <= "
                    f"{FIRST_TOKEN_TARGET_S:.0f} s) {'tiny model' if model else 'default model'}")
    return []  # a figure: it fails by raising

