"""benchmarks/cpu_matmul_units.cc, the two-thread driver of the packed matmul's units, still
builds against the kernel's internals and computes the products it times (its timings are never
checked)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import jax
import pytest

from jaxengine_kernels.cpu import native

DRIVER = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_matmul_units.cc"


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    exe = tmp_path_factory.mktemp("matmul") / "units"
    subprocess.run([native._compiler(), "-O1", "-std=c++17", "-w", "-march=native",
                    "-I", jax.ffi.include_dir(), str(DRIVER), "-o", str(exe), "-lpthread"],
                   check=True)
    return exe


# A row block's unit (5 rows), a chunked one (13: three blocks sharing the prefetches) and a
# long run (97: two runs, of 96 rows and of 1, in the kernel's unit order), fused SwiGLU and the
# plain product.
@pytest.mark.parametrize("mode", ["glu", "down"])
def test_the_driver_times_the_rows_it_is_given_and_computes_the_product(driver: Path,
                                                                         mode: str) -> None:
    out = subprocess.run([str(driver), mode, "1", "5", "13", "97"], capture_output=True,
                         text=True, check=True).stdout
    line = rf"^{mode} rows=(\d+): [\d.]+ ms, [\d.]+ GB/s, [\d.]+ GFLOP/s$"
    assert re.findall(line, out, re.M) == ["5", "13", "97"]
    match = re.search(r"max difference from the plain loop: (\S+)", out)
    assert match and float(match[1]) < 1e-4  # sums of ~1e-3, float32 against double
