"""`$JAXENGINE_CPU_ISA`: each named x86 level builds with its own flags and, in a fresh process,
loads the path it names (as the binary reports it); unknown names, levels this CPU cannot
execute and x86 levels elsewhere are clear errors, never a silent fallback or an illegal
instruction."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

import jaxengine_kernels
from jaxengine_kernels.cpu import native

REPO = Path(__file__).resolve().parents[2]
V3_CPU = frozenset(native.X86_ISAS["avx2"][1])  # flags of an AVX2 machine without AVX-512


def test_each_name_maps_to_its_march_flag():
    assert native.isa_flags("native") == ("-march=native",)
    if native._is_x86():
        runnable = native.runnable_isas()
        assert runnable[0] == "native" and "sse2" in runnable  # every x86-64 runs the baseline
        assert [native.isa_flags(n) for n in runnable[1:]] == [
            (native.X86_ISAS[n][0],) for n in runnable[1:]]


def test_an_unknown_name_is_refused_naming_the_variable_and_the_choices():
    with pytest.raises(ValueError, match=r"JAXENGINE_CPU_ISA='avx3' .* native, avx512, avx2, "
                                         r"sse2"):
        native.isa_flags("avx3")


def test_a_level_the_cpu_cannot_execute_is_refused_naming_the_missing_flags(monkeypatch):
    monkeypatch.setattr(native, "_is_x86", lambda: True)
    monkeypatch.setattr(native, "_cpu_flags", lambda: V3_CPU)
    assert native.runnable_isas() == ("native", "avx2", "sse2")
    assert native.isa_flags("avx2") == ("-march=x86-64-v3",)
    missing = "avx512bw, avx512cd, avx512dq, avx512f, avx512vl"
    with pytest.raises(ValueError, match=rf"'avx512': this CPU lacks {missing}, .* use one of "
                                         r"native, avx2, sse2"):
        native.isa_flags("avx512")
    monkeypatch.setattr(native, "_cpu_flags", lambda: None)  # no /proc/cpuinfo: nothing known
    with pytest.raises(ValueError, match=r"may lack \(no /proc/cpuinfo\) cx16"):
        native.isa_flags("avx2")
    assert native.isa_flags("sse2") == ("-march=x86-64",)


def test_x86_levels_are_refused_on_other_machines(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert native.runnable_isas() == ("native",)
    with pytest.raises(ValueError, match="names an x86 level, and this machine is aarch64"):
        native.isa_flags("sse2")


def test_a_wrong_variable_is_an_error_not_the_reference(monkeypatch):
    """The engine asks `available()` which kernel to take: a mistake in the variable must
    reach the user, not turn into the several times slower jnp reference."""
    monkeypatch.setenv(native.ENV_ISA, "avx3")
    monkeypatch.setattr(native, "_library", [])  # as in a process that has not loaded it
    native.available.cache_clear()
    try:
        with pytest.raises(ValueError, match="JAXENGINE_CPU_ISA='avx3'"):
            jaxengine_kernels.default_impl("cpu")
    finally:
        native.available.cache_clear()


# A fresh process with the variable set: the path its library reports, and a small batch of
# decodes and a chunk against the numpy oracle.
PROBE = """
import jax.numpy as jnp, numpy as np
from jaxengine_kernels.cpu import native, ragged_paged_attention_cpu
from tests.jaxengine_kernels.cases import make_case, numpy_oracle
case = make_case([(1, 40), (9, 30), (2, 70)], num_heads=4, num_kv_heads=2, head_dim=24,
                 page_size=8, seed=1)
out, _ = ragged_paged_attention_cpu(*case.args(jnp.float32), sm_scale=case.sm_scale)
want, _ = numpy_oracle(case)
print(native.isa(), native.vector_lanes(), np.abs(np.asarray(out)[:case.num_tokens] - want).max())
"""


@pytest.mark.parametrize("isa", native.X86_ISAS)
def test_a_process_started_with_the_variable_runs_that_build(isa, isa_library):
    isa_library(isa)  # built into native's cache, or skipped where the CPU cannot run it
    env = {**os.environ, native.ENV_ISA: isa, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    name, lanes, error = done.stdout.split()
    assert (name, int(lanes)) == (isa, {"avx512": 16, "avx2": 8, "sse2": 4}[isa])
    assert float(error) < 2e-5
