"""Two processes on loopback, 2 CPU devices each, joined by `jax.distributed` (gloo
collectives): offline outputs equal one process's, and `jaxengine serve` with a `--headless`
follower answers as the offline engine does, then stops both when process 0 stops.

Every child runs in its own process group with a deadline and is killed in `finally`; ports are
free ones on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from jaxengine.llm import LLM
from scheduler import SamplingParams
from tests.jaxengine.scale_out import multihost_offline as offline
from tests.parallel_helpers import REPO, device_env
from tests.server_processes import free_port, wait_healthy

WORKER = Path(offline.__file__)
TP = 4  # tensor parallel over all 4 global devices: each process holds half of the model
DEVICES_PER_PROCESS = 2
SMALL = ["--max-num-batched-tokens", "32", "--max-num-seqs", "4", "--block-size", "4",
         "--max-model-len", "128", "--num-gpu-blocks-override", "80"]


@contextmanager
def _processes(commands: Sequence[Sequence[str]], logs: Sequence[Path]
               ) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start each command (stdout and stderr to its log), in its own process group; on the way
    out kill whichever is still running."""
    procs = []
    try:
        for cmd, log in zip(commands, logs, strict=True):
            with open(log, "wb") as out:
                procs.append(subprocess.Popen(
                    list(cmd), cwd=REPO, env=device_env(DEVICES_PER_PROCESS), stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True))
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


def _wait_all(procs: Sequence[subprocess.Popen[bytes]], logs: Sequence[Path], timeout: float
              ) -> list[int]:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for q in procs:  # multihost_offline.py dumps its threads' stacks into its log
                if q.poll() is None:
                    q.send_signal(signal.SIGUSR1)
            time.sleep(2)
            raise AssertionError(f"still running after {timeout:.0f}s:\n"
                                 + "\n".join(_tail(lg, 12000) for lg in logs)) from None
    return [p.returncode for p in procs]


def _tail(log: Path, n: int = 4000) -> str:
    return f"--- {log.name}\n{log.read_text(errors='replace')[-n:]}"


def _run_offline(tmp_path: Path, extra: Sequence[dict[str, Any]] = ({}, {})
                 ) -> list[tuple[int, str, str]]:
    """Both processes of multihost_offline.py; (exit status, the last RESULT or VALUE_ERROR
    line, the whole log) of each."""
    coordinator = f"127.0.0.1:{free_port()}"
    cmds = [[sys.executable, str(WORKER), str(i), coordinator, str(TP), json.dumps(extra[i])]
            for i in range(2)]
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    with _processes(cmds, logs) as procs:
        codes = _wait_all(procs, logs, timeout=120)
    lines = []
    for code, log in zip(codes, logs, strict=True):
        text = log.read_text()
        found = [ln for ln in text.splitlines() if ln.startswith(("RESULT ", "VALUE_ERROR "))]
        assert found, _tail(log)
        lines.append((code, found[-1], text))
    return lines


def _layout(log_text: str) -> dict[str, Any]:
    line = next(ln for ln in log_text.splitlines() if ln.startswith("LAYOUT "))
    return json.loads(line.removeprefix("LAYOUT "))


@pytest.fixture(scope="module")
def one_process() -> list[dict[str, Any]]:
    """The offline workload on this process's single device: the reference."""
    return offline.summarize(LLM(offline.MODEL, **offline.ENGINE))


# About 1 in 2 fresh-clone suite runs (never this module alone, nor a loop of it) stall both
# processes mid-generation in a step's collective: docs/JAX_NOTES.md, "Multi-host". Run it with
# -m stalls until that is found.
@pytest.mark.stalls
def test_two_processes_give_one_process_outputs(tmp_path: Path,
                                                one_process: list[dict[str, Any]]) -> None:
    (code0, line0, log0), (code1, line1, log1) = _run_offline(tmp_path)
    assert (code0, code1) == (0, 0), (line0, line1)
    for log in (log0, log1):  # one mesh over both processes' devices, the model split on it
        for part in _layout(log).values():
            assert part == {"processes": [0, 1], "devices": 4, "split": True}, log
    got0, got1 = (json.loads(line.removeprefix("RESULT ")) for line in (line0, line1))
    assert got0 == got1  # the same script on every host: the same outputs everywhere
    for got, want in zip(got0, one_process, strict=True):
        assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
        for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
            assert (a is None and b is None) or abs(a - b) < 1e-4


@pytest.mark.slow  # two processes and a one-process reference of a MoE model
def test_two_processes_serve_a_moe_model_with_expert_parallelism(tmp_path: Path) -> None:
    """Multi-host is unchanged for a MoE model: its experts split whole over the four devices
    of two processes give one process's outputs."""
    moe = "tests/fixtures/tiny/qwen2_moe"
    want = offline.summarize(LLM(moe, **offline.ENGINE))
    extra = {"model": moe, "enable_expert_parallel": True}
    (code0, line0, _), (code1, line1, _) = _run_offline(tmp_path, (extra, extra))
    assert (code0, code1) == (0, 0), (line0, line1)
    for line in (line0, line1):
        got = json.loads(line.removeprefix("RESULT "))
        assert [g["token_ids"] for g in got] == [w["token_ids"] for w in want]


def test_processes_started_with_different_arguments_all_refuse(tmp_path: Path) -> None:
    results = _run_offline(tmp_path, extra=({}, {"max_num_seqs": 3}))
    for code, line, _ in results:
        assert code == 3 and "different engine arguments" in line, results


# ---- serving: process 0 over HTTP, process 1 headless ---------------------------------------

def _serve_commands(coordinator: str, http_port: int) -> list[list[str]]:
    base = [sys.executable, "-m", "jaxengine", "serve", offline.MODEL, *SMALL,
            "--tensor-parallel-size", str(TP), "--coordinator-address", coordinator,
            "--num-processes", "2", "--log-interval", "0", "--served-model-name", "tiny"]
    return [[*base, "--process-id", "0", "--host", "127.0.0.1", "--port", str(http_port)],
            [*base, "--process-id", "1", "--headless"]]


def _complete(base: str, prompt: Any, params: SamplingParams) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": params.max_tokens,
            "temperature": params.temperature, "ignore_eos": True}
    if params.seed is not None:
        body["seed"] = params.seed
    r = httpx.post(f"{base}/v1/completions", json=body, trust_env=False, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _leave_early(base: str) -> None:
    """A streaming client that reads one chunk and goes: process 0 aborts its request."""
    body = {"model": "tiny", "prompt": [4, 4, 4], "max_tokens": 100, "stream": True,
            "ignore_eos": True, "temperature": 0.0}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, trust_env=False,
                      timeout=120) as r:
        next(r.iter_lines())


@pytest.mark.slow  # 30 s: two serve processes; the two-process engine test covers the mesh
def test_headless_follower_serves_with_process_0_and_stops_with_it(
        tmp_path: Path, one_process: list[dict[str, Any]]) -> None:
    work = [(p["prompt_token_ids"] if isinstance(p, dict) else p, sp)
            for p, sp in zip(offline.PROMPTS, offline.PARAMS, strict=True)
            if sp.seed is not None or sp.temperature == 0.0]  # reproducible through HTTP
    want = [row["text"] for row, (p, sp) in zip(one_process, zip(offline.PROMPTS,
            offline.PARAMS, strict=True), strict=True) if sp.seed is not None
            or sp.temperature == 0.0]
    http_port = free_port()
    base = f"http://127.0.0.1:{http_port}"
    logs = [tmp_path / "serve0.log", tmp_path / "serve1.log"]
    with _processes(_serve_commands(f"127.0.0.1:{free_port()}", http_port), logs) as procs:
        wait_healthy(base, procs, lambda: "\n".join(_tail(lg) for lg in logs))
        got: dict[int, str] = {}
        threads = [threading.Thread(target=lambda i=i, w=w: got.__setitem__(i, _complete(
            base, *w))) for i, w in enumerate(work)]
        threads.append(threading.Thread(target=_leave_early, args=(base,)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [got.get(i) for i in range(len(work))] == want
        assert _complete(base, *work[0]) == want[0]  # after the abort, still in lockstep
        busy = threading.Thread(target=_complete, args=(base, [2, 3], SamplingParams(
            max_tokens=60, temperature=0.0)), daemon=True)
        busy.start()
        time.sleep(0.5)
        procs[0].send_signal(signal.SIGTERM)  # as a supervisor stops it, steps in flight
        codes = _wait_all(procs, logs, timeout=60)
    assert codes == [0, 0], "\n".join(_tail(lg) for lg in logs)
    assert "process 0 shut down after" in logs[1].read_text()
