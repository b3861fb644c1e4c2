"""JAX's persistent compilation cache as the engine configures it: where it lives, that loads
from it are counted (as compilations and as cache hits), and that its keys keep programs of
another dtype apart, across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from jaxengine.model.fake import fake_model
from jaxengine.runner.compilation_cache import ENV, configure, default_cache_dir, resolve_cache_dir
from jaxengine.runner.compiles import (
    cache_hit_count,
    compile_count,
    compiles_by_name,
    ensure_listener,
)
from jaxengine.runner.config import RunnerConfig
from jaxengine.runner.penalty_inputs import WRITE_SLOT_NAME
from jaxengine.runner.programs import SAMPLE_NAME, STEP_NAME
from jaxengine.runner.runner import Runner
from tests.conftest import CACHE_ENV, SUITE_CACHE_ENV

CHILD = Path(__file__).with_name("compilation_cache_child.py")
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def cache_at(tmp_path: Path) -> Iterator[Path]:
    """The process's cache moved to a fresh directory for one test, then back to the suite's."""
    configure(str(tmp_path))
    yield tmp_path
    configure(None)


def test_the_suite_runs_with_its_own_cache_setting() -> None:
    # tests/conftest.py: never the user's ~/.cache, never a stale directory from another run
    # (unless the variable was set on purpose, e.g. to run warm)
    assert CACHE_ENV == ENV and ENV in os.environ
    assert resolve_cache_dir(None) == (str(Path(os.environ[ENV]).absolute())
                                       if os.environ[ENV].strip() else None)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and SUITE_CACHE_ENV in os.environ:  # under `make test`: a directory per worker
        assert Path(os.environ[ENV]) == Path(os.environ[SUITE_CACHE_ENV]) / worker


def test_where_the_cache_lives(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "jaxengine" / "jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "jaxengine" / "jax"
    assert resolve_cache_dir("") is None and resolve_cache_dir("  ") is None
    assert resolve_cache_dir("~/c") == str(Path.home() / "c")
    monkeypatch.setenv(ENV, "")
    assert resolve_cache_dir(None) is None  # the variable can disable it too
    monkeypatch.setenv(ENV, str(tmp_path / "x"))
    assert resolve_cache_dir(None) == str(tmp_path / "x")
    assert resolve_cache_dir(str(tmp_path / "y")) == str(tmp_path / "y")  # explicit wins


def _probe() -> Any:
    """A fresh jitted function: each call of `_probe` misses jit's in-memory cache, while its
    program (and so its persistent-cache key) is the same every time."""
    def jaxengine_cache_probe(x: jax.Array) -> jax.Array:
        return jnp.tanh(x) @ x.T
    return jax.jit(jaxengine_cache_probe)


def test_a_program_loaded_from_the_cache_counts_as_a_compilation_and_a_hit(cache_at: Path
                                                                         ) -> None:
    ensure_listener()
    name, x = "jaxengine_cache_probe", jnp.ones((8, 8))
    before, hits = compile_count(name), cache_hit_count(name)
    by_name = compiles_by_name(name, "jaxengine_model_step", this_thread=True)
    _probe()(x).block_until_ready()
    assert (compile_count(name) - before, cache_hit_count(name) - hits) == (1, 0)
    assert len(list(cache_at.glob("jit_jaxengine_cache_probe-*"))) == 1  # written
    _probe()(x).block_until_ready()  # another function object: read back from the directory
    assert (compile_count(name) - before, cache_hit_count(name) - hits) == (2, 1)
    # by name, as a RecompileError says what compiled
    new = compiles_by_name(name, "jaxengine_model_step", this_thread=True) - by_name
    assert (new.total, str(new)) == (2, "jit(jaxengine_cache_probe) x2 (1 from the cache)")
    configure("")  # disabled: compiled again, nothing read
    _probe()(x).block_until_ready()
    assert (compile_count(name) - before, cache_hit_count(name) - hits) == (3, 1)
    assert jax.config.jax_compilation_cache_dir is None


def test_a_second_engine_with_another_directory_moves_the_process_cache(tmp_path: Path,
                                                                       cache_at: Path) -> None:
    other = tmp_path / "other"
    assert configure(str(other)) == str(other)
    assert jax.config.jax_compilation_cache_dir == str(other)
    _probe()(jnp.ones((4, 4))).block_until_ready()
    assert len(list(other.glob("jit_jaxengine_cache_probe-*"))) == 1  # written to the new one


def test_a_warm_cache_keeps_the_precompile_guarantees(cache_at: Path) -> None:
    # A program loaded from the cache is counted like one compiled: precompile reports every
    # bucket either way, and after warm-up nothing is loaded or compiled.
    config = RunnerConfig(max_num_batched_tokens=20, max_num_seqs=3, max_model_len=36,
                          block_size=4, num_blocks=16, max_logprobs=20,
                          intermediate_token_buckets=False, debug_recompiles=True,
                          num_speculative_tokens=0)
    # fake_model is functools.cache'd; __wrapped__ builds a new object of the same programs
    cold = Runner(fake_model.__wrapped__(89), config)
    cold.precompile(progress=False)
    # every bucket's program and the penalty-slot writer, each compiled or loaded whole
    programs = len(cold.token_buckets) + len(cold.request_buckets) + 1
    hits = cache_hit_count(STEP_NAME, SAMPLE_NAME, WRITE_SLOT_NAME)
    warm = Runner(fake_model.__wrapped__(89), config)  # jit's memory cache misses
    warm.precompile(progress=False)
    assert cold.stats.compilations == warm.stats.compilations == programs
    assert cache_hit_count(STEP_NAME, SAMPLE_NAME, WRITE_SLOT_NAME) - hits == programs  # disk
    assert warm.stats.compilations_after_warmup == 0


def _child(cache_dir: Path | str, dtype: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(CHILD), str(cache_dir), dtype], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def float32_cold(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A fresh cache directory and the float32 child that filled it."""
    cache = tmp_path_factory.mktemp("shared_cache")
    return cache, _child(cache, "float32")


@pytest.mark.slow  # two child processes, about 25 s
def test_a_second_process_loads_every_program_instead_of_compiling(
        float32_cold: tuple[Path, dict[str, Any]]) -> None:
    cache, cold = float32_cold
    warm = _child(cache, "float32")
    assert cold["cache_hits"] == 0 and cold["compiled"] == cold["buckets"]
    assert warm["cache_hits"] == warm["compiled"] == warm["buckets"]
    assert warm["after_warmup"] == 0  # debug_recompiles would have raised anyway
    assert (warm["tokens"], warm["logprobs"]) == (cold["tokens"], cold["logprobs"])


@pytest.mark.slow  # three child processes, about 40 s
def test_a_bfloat16_engine_never_loads_a_float32_program(
        float32_cold: tuple[Path, dict[str, Any]]) -> None:
    cache, f32 = float32_cold
    shared = _child(cache, "bfloat16")
    alone = _child("", "bfloat16")
    assert shared["cache_hits"] == 0 and alone["cache_hits"] == 0
    assert shared["compiled"] == shared["buckets"]
    assert (shared["tokens"], shared["logprobs"]) == (alone["tokens"], alone["logprobs"])
    assert shared["logprobs"] != f32["logprobs"]  # the dtypes' outputs do differ

