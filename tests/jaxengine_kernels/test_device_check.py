"""benchmarks/device_check.py runs end to end on CPU (--cpu-smoke), so it still works the day
an accelerator is lent; and its HLO check tells a step with the kernel from one without."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from benchmarks.device_sections import kernel, model
from benchmarks.device_sections.context import Context
from jaxengine.model.config import ModelConfig

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "device_check.py"


@pytest.mark.slow  # 150 s unloaded; test_hlo_check_* below keeps the HLO check in the default run
def test_cpu_smoke_prints_every_section_and_passes() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke"], capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("device_check: backend=cpu") and "impls=tpu,gpu" in lines[0]
    tagged = [line for line in lines if line.startswith("[")]
    for impl in ("tpu", "gpu"):
        mine = [line for line in tagged if f"] {impl} " in line or f" {impl}: " in line]
        correct = [line for line in mine if line.startswith("[correctness]")]
        assert len(correct) == 4 and all(line.endswith("PASS") for line in correct)
        assert {"garbage=nan", "garbage=+inf"} <= {w for line in correct for w in line.split()}
        hlo = [line for line in mine if line.startswith("[engine-hlo]")]
        assert len(hlo) == 1 and kernel.CUSTOM_CALL[impl] + " found x" in hlo[0]
        assert "reference not found PASS" in hlo[0]
        assert sum(line.startswith("[timing]") for line in mine) == 2
        assert sum(line.startswith("[bandwidth]") and "% of 4800 GB/s" in line
                   for line in mine) == 2  # fmt: skip
    weights = [line for line in tagged if line.startswith("[weights]")]
    assert [line.split(":")[0] for line in weights] == [
        "[weights] bf16", "[weights] int8", "[weights] fp8 (weight-only)",
        "[weights] bf16 + fp8 KV"]  # this CPU does not multiply fp8
    families = [line for line in tagged if line.startswith("[families]")]
    assert sum(line.endswith("PASS") for line in families) == 4  # 2 models x 2 kernels
    assert sum("ragged_dot x" in line for line in families) == 2  # the MoE model's
    assert sum("decode step" in line for line in families) == 2
    first = [line for line in tagged if line.startswith("[first-token]")]
    assert [line.split(":")[0] for line in first] == ["[first-token] cold",
                                                      "[first-token] warm"]
    assert all("s from process start to 1 token" in line for line in first)
    assert lines[-1].startswith("summary: PASS")


@pytest.mark.slow  # 50 s: compiles and times two tiny models; the smoke above covers it too
def test_families_section_finds_both_kernels_in_the_abstract_steps(capsys) -> None:
    ctx = Context(impls=("tpu", "gpu"), interpret=True, smoke=True, quick=True,
                               peak_gbps=4800.0, iters=1)
    assert model.families(ctx) == []
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out if line.endswith("PASS")] == [
        f"[families] {m} {i} lowered (abstract device)"
        for m in ("gemma3-tiny", "mixtral-tiny") for i in ("tpu", "gpu")]
    assert all("ragged_dot x" in line for line in out if "mixtral" in line and "PASS" in line)


def test_hlo_check_fails_on_a_step_over_the_reference(capsys) -> None:
    cfg = ModelConfig.tiny(hidden_size=64, head_dim=64)
    jitted, args, statics = kernel.engine_step(cfg, "reference", jnp.float32)
    text = jitted.lower(*args, **statics).as_text()
    assert not kernel.check_text("gpu", "lowered", text, require_call=True)
    assert not kernel.check_text("gpu", "compiled", text, require_call=False)
    out = capsys.readouterr().out
    assert "__gpu$xla.gpu.triton NOT FOUND" in out and "reference FOUND" in out
    assert out.count("FAIL") == 2
