"""Suite-wide setup: JAX's persistent compilation cache and the weight cache in fresh temporary
directories, and compiled programs freed after each test module.

The engine turns the cache on by default (`jaxengine/runner/compilation_cache.py`), and child
processes (serve, the CLI) inherit the setting. A directory of its own per run keeps the suite
from writing into the user's ~/.cache and from depending on entries a stale run left behind; the
cache itself still runs, as it does for users. Under pytest-xdist (`make test`) each worker
takes a subdirectory of the run's: jax writes an entry in place, so a worker reading a program
another is still writing would get a truncated file (jax warns, and warnings fail tests). To run
warm or without it, set JAXENGINE_COMPILATION_CACHE_DIR yourself (a directory, or '' to
disable): it is left alone, workers included. The weight cache (jaxengine/loading/weight_cache.py,
JAXENGINE_WEIGHT_CACHE_DIR) likewise gets a directory of the run's, which its workers share (an
entry's files are renamed into place whole).

Every program XLA compiles on CPU keeps memory mappings for its code until it is freed, and a
process may hold at most vm.max_map_count of them (65530 here): the whole suite in one process
reached ~62 000 and then crashed (SIGSEGV in the next compilation's serialization). Clearing
jax's caches after each module lets the programs of finished modules go.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator

import pytest

# jaxengine.runner.compilation_cache.ENV, spelled out so that collecting the pure-Python
# scheduler tests does not import jax; test_compilation_cache.py checks the two agree.
CACHE_ENV = "JAXENGINE_COMPILATION_CACHE_DIR"
SUITE_CACHE_ENV = "JAXENGINE_TEST_SUITE_CACHE"  # the run's directory, seen by xdist's workers
WEIGHT_CACHE_ENV = "JAXENGINE_WEIGHT_CACHE_DIR"  # jaxengine.loading.weight_cache.ENV
PROGRAMS_THREAD = "jaxengine-programs"  # jaxengine.runner.bucket_programs.THREAD_NAME
_made: list[str] = []
_made_weights: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """Point the compilation cache at a new temporary directory unless one is set; an xdist
    worker (started after its controller configured) at a subdirectory of its own. The
    weight cache the same, shared by the workers."""
    del config
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and SUITE_CACHE_ENV in os.environ:
        os.environ[CACHE_ENV] = os.path.join(os.environ[SUITE_CACHE_ENV], worker)
    elif CACHE_ENV not in os.environ:
        _made.append(tempfile.mkdtemp(prefix="jaxengine-jax-cache-"))
        os.environ[CACHE_ENV] = os.environ[SUITE_CACHE_ENV] = _made[0]
    if WEIGHT_CACHE_ENV not in os.environ:  # workers inherit their controller's
        _made_weights.append(tempfile.mkdtemp(prefix="jaxengine-weights-"))
        os.environ[WEIGHT_CACHE_ENV] = _made_weights[0]


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the directories `pytest_configure` made, once the background program making of
    the engines tests left unshut has ended (it writes into the compilation cache)."""
    del config
    for thread in threading.enumerate():
        if thread.name == PROGRAMS_THREAD:
            thread.join()
    for path in _made:
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop(CACHE_ENV, None)
        os.environ.pop(SUITE_CACHE_ENV, None)
    for path in _made_weights:
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop(WEIGHT_CACHE_ENV, None)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs() -> Iterator[None]:
    """After each module, drop jax's caches of compiled programs (if jax was imported)."""
    yield
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()
        gc.collect()
