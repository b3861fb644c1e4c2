"""benchmarks/cpu_kernel_units.cc, the single-thread driver of the CPU kernel's units, still
builds against the kernel's internals and runs them (its timings are never checked)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import jax

from jaxengine_kernels.cpu import native

DRIVER = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_kernel_units.cc"


def test_the_driver_builds_and_runs_every_unit(tmp_path: Path) -> None:
    exe = tmp_path / "units"
    subprocess.run([native._compiler(), "-O1", "-std=c++17", "-w", "-I",
                    jax.ffi.include_dir(), str(DRIVER), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe), "decodes", "32", "2"], capture_output=True, text=True,
                         check=True)
    # 64 decodes at context 300: one unit each (19 pages, under 32 per split).
    match = re.fullmatch(r"decodes block_q=32 units=(\d+): [\d.]+ ms, [\d.]+ GFLOP/s, "
                         r"checksum (-?[\d.]+)\n", out.stdout)
    assert match and int(match[1]) == 64
    out = subprocess.run([str(exe), "chunk", "16", "1"], capture_output=True, text=True,
                         check=True)
    assert "units=48:" in out.stdout  # 768 tokens in runs of 16
    # 64 decodes at context 1500: 94 pages each, three split units, whose states are merged
    # (without the merge every output row would stay zero, and so would the checksum).
    out = subprocess.run([str(exe), "long-decodes", "32", "1"], capture_output=True, text=True,
                         check=True)
    match = re.search(r"units=(\d+):.*checksum (-?[\d.]+)", out.stdout)
    assert match and int(match[1]) == 192 and float(match[2]) != 0.0
    # The batch-invariant mode splits nothing; the outputs agree to the printed digits.
    out = subprocess.run([str(exe), "long-decodes", "32", "1", "1"], capture_output=True,
                         text=True, check=True)
    invariant = re.search(r"units=(\d+):.*checksum (-?[\d.]+)", out.stdout)
    assert invariant and int(invariant[1]) == 64 and invariant[2] == match[2]
