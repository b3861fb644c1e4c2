"""Run code on N virtual CPU devices, in a fresh interpreter (mesh tests of issue 12).

jax fixes its device count when it is first imported, from
`XLA_FLAGS=--xla_force_host_platform_device_count=N`; the pytest process has long imported it
with one device, so a mesh test runs its checks in a child process:

- `run_python(source, num_devices=8)`: a Python snippet; returns its stdout.
- `run_pytest(["tests/.../tp_checks.py::test_x"], num_devices=8)`: pytest on a module that
  the default run does not collect (name it without the `test_` prefix; pytest collects a file
  given on its command line whatever its name). Run with `-m slow` to include slow ones.

Both fail the calling test with the child's output when it exits non-zero or runs past
`timeout` seconds (its whole process group is killed then).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def device_env(num_devices: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with jax on CPU and `num_devices` virtual devices."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    env["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_COUNT_FLAG}={num_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def run_command(argv: Sequence[str], *, num_devices: int, timeout: float,
                env: Mapping[str, str] | None = None) -> str:
    """Run `argv` in the repository with `num_devices` CPU devices; return stdout.

    Raises:
        AssertionError: it exited non-zero or timed out; the message holds its output.
    """
    proc = subprocess.Popen(list(argv), cwd=REPO, env=device_env(num_devices, env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own group, so a kill gets children
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout:.0f}s: {' '.join(argv)}\n"
                             f"--- stdout\n{out}\n--- stderr\n{err}") from None
    if proc.returncode != 0:
        raise AssertionError(f"exit code {proc.returncode}: {' '.join(argv)}\n"
                             f"--- stdout\n{out}\n--- stderr\n{err}")
    return out


def run_python(source: str, *, num_devices: int, timeout: float = 120.0,
               env: Mapping[str, str] | None = None) -> str:
    """Run a Python snippet with `num_devices` CPU devices; return its stdout."""
    return run_command([sys.executable, "-c", source], num_devices=num_devices,
                       timeout=timeout, env=env)


def run_pytest(targets: Sequence[str], *, num_devices: int, timeout: float = 300.0,
               args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> str:
    """Run pytest on `targets` (paths or node ids, relative to the repository) with
    `num_devices` CPU devices; return its output. `args` go to pytest (e.g. `-m slow`)."""
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, *targets]
    return run_command(argv, num_devices=num_devices, timeout=timeout, env=env)
