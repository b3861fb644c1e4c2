"""The weight cache (jaxengine/loading/weight_cache.py): a load from it gives the fresh load's
parameters bit for bit without parsing the file; a changed file or derivation code misses; an
unreadable entry is logged and derived again."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxengine.loading import load as load_module
from jaxengine.loading import load_model
from jaxengine.loading.weight_cache import ENV, WeightCache
from jaxengine.loading.weights import model_weight_shapes
from jaxengine.model.decoder import Model
from tests.conftest import WEIGHT_CACHE_ENV
from tests.jaxengine.model.quant.gguf_files import blocks_config, write_blocks_gguf

Q = gguf.GGMLQuantizationType


def _params(model: Model) -> dict[str, np.ndarray]:
    return {".".join(map(str, path)): np.asarray(var.get_value())
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _assert_same(got: Model, want: Model) -> None:
    got_params, want_params = _params(got), _params(want)
    assert got_params.keys() == want_params.keys()
    for name, array in want_params.items():
        assert got_params[name].dtype == array.dtype, name
        np.testing.assert_array_equal(got_params[name].view(np.uint8), array.view(np.uint8),
                                      err_msg=name)


def _fresh(path: Path, monkeypatch: pytest.MonkeyPatch) -> Model:
    """`path` loaded without the cache."""
    with monkeypatch.context() as m:
        m.setenv(ENV, "")
        return load_model(path, with_tokenizer=False)[0]


@pytest.fixture
def cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny Q4_1 GGUF file, and the cache pointed at a directory of the test's."""
    monkeypatch.setenv(ENV, str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    write_blocks_gguf(path, blocks_config(), Q.Q4_1)
    return path


def _entries(path: Path) -> list[Path]:
    return sorted((path.parent / "cache").iterdir())


def test_a_cached_load_gives_the_fresh_load_bit_for_bit(
        cached: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = _fresh(cached, monkeypatch)
    first, cfg, _ = load_model(cached, with_tokenizer=False)  # derives and saves
    [entry] = _entries(cached)
    assert (entry / "header.json").is_file()
    assert {f.name for f in entry.glob("*.npy")} == {
        "-".join(path) + ".float32.npy" for path in model_weight_shapes(cfg)}

    def unopened(path: str) -> None:
        raise AssertionError(f"{path} was parsed although its entry is whole")

    monkeypatch.setattr(load_module, "open_gguf", unopened)
    again, cfg_again, tokenizer = load_model(cached)
    assert cfg_again == cfg and tokenizer is not None and tokenizer.eos_token_id == 2
    _assert_same(first, fresh)
    _assert_same(again, fresh)


def test_a_changed_file_or_code_misses(cached: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    load_model(cached, with_tokenizer=False)
    [old] = _entries(cached)
    stat = os.stat(cached)
    # other weights, same size and modification time: the header's hash tells them apart
    write_blocks_gguf(cached, blocks_config(), Q.Q4_1, seed=7)
    os.utime(cached, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(cached).st_size == stat.st_size
    changed = load_model(cached, with_tokenizer=False)[0]
    _assert_same(changed, _fresh(cached, monkeypatch))
    root = cached.parent / "cache"
    new = WeightCache(root, str(cached)).dir
    assert sorted(_entries(cached)) == sorted([old, new])  # the newest other entry is kept
    assert WeightCache(root, str(cached), version="another derivation").dir != new
    os.utime(cached, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    load_model(cached, with_tokenizer=False)
    assert old not in _entries(cached) and new in _entries(cached) and len(_entries(cached)) == 2


def test_an_unreadable_entry_is_logged_and_derived_again(
        cached: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    load_model(cached, with_tokenizer=False)
    [entry] = _entries(cached)
    kernel = next(entry.glob("layers-mlp-down_proj-kernel.*.npy"))
    kernel.write_bytes(kernel.read_bytes()[:-100])  # truncated
    (entry / "header.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="jaxengine.loading"):
        model = load_model(cached, with_tokenizer=False)[0]
    logged = [r.getMessage() for r in caplog.records]
    assert any(f"{kernel} does not read" in m for m in logged), logged
    assert any("header.json does not read" in m for m in logged), logged
    _assert_same(model, _fresh(cached, monkeypatch))
    # the entry is whole again: the next load reads it without parsing the file
    caplog.clear()
    monkeypatch.setattr(load_module, "open_gguf", None)
    _assert_same(load_model(cached, with_tokenizer=False)[0], model)
    assert not caplog.records


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_an_array_reads_back_bit_for_bit_in_its_dtype(tmp_path: Path, dtype: np.dtype) -> None:
    file = tmp_path / "m.gguf"
    file.write_bytes(b"GGUF")
    cache = WeightCache(tmp_path / "cache", str(file))
    array = (np.arange(-6, 6, dtype=np.float32) / 7).astype(dtype).reshape(3, 4)
    cache.put(("layers", "norm", "scale"), array)
    got = cache.get(("layers", "norm", "scale"), (3, 4), dtype)
    assert got.dtype == array.dtype
    np.testing.assert_array_equal(got.view(np.uint8), array.view(np.uint8))
    assert cache.get(("layers", "norm", "scale"), (4, 3), dtype) is None  # logged
    assert cache.get(("norm", "scale"), (3, 4), dtype) is None  # absent


def test_the_suite_points_the_cache_at_its_own_directory() -> None:
    """tests/conftest.py spells the variable out; the suite never writes to ~/.cache."""
    assert WEIGHT_CACHE_ENV == ENV and ".cache" not in os.environ[ENV]
