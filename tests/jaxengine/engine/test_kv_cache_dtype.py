"""`kv_cache_dtype` (vLLM's values) from the arguments to the pool: the names refused or
resolved, the pool made in that dtype and sized by its bytes, and the `cache_config_info` gauge
that says so."""

from __future__ import annotations

import argparse
import logging

import jax.numpy as jnp
import pytest

from jaxengine.config import resolve_kv_cache_dtype
from jaxengine.engine import build
from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import build_engine
from jaxengine.flags import add_engine_flags, engine_args_from
from jaxengine.llm import LLM
from jaxengine.metrics import Gauge
from jaxengine.model.config import ModelConfig
from jaxengine.replicas.data_parallel import DataParallelEngine
from jaxengine.server.async_engine import AsyncEngine
from jaxengine_kernels import UnsupportedShapeError, gpu
from tests.jaxengine.engine.test_llm_engine import make_engine
from tests.jaxengine.metrics.test_metrics import _value

TINY = "tests/fixtures/tiny/llama3_gqa"  # 2 layers, 2 KV heads of 8
# One page of 4 tokens: 2 layers x (K and V) x 2 heads x 8 x 4 tokens = 256 values.
VALUES_PER_BLOCK = 2 * 2 * 2 * 8 * 4


def test_vllms_names_resolve_to_one_dtype_each() -> None:
    assert resolve_kv_cache_dtype("auto", "float32") == "float32"
    assert resolve_kv_cache_dtype("auto", "bfloat16") == "bfloat16"
    assert resolve_kv_cache_dtype("bfloat16", "float32") == "bfloat16"
    assert resolve_kv_cache_dtype("fp8", "float32") == "float8_e4m3fn"
    assert resolve_kv_cache_dtype("fp8_e4m3", "bfloat16") == "float8_e4m3fn"
    assert resolve_kv_cache_dtype("fp8_e5m2", "float32") == "float8_e5m2"


@pytest.mark.parametrize("bad", ["float16", "float32", "int8", "fp8_inc", "FP8", None])
def test_other_values_are_refused_naming_the_field_and_the_choices(bad: object) -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, bfloat16, fp8, "
                                         r"fp8_e4m3, fp8_e5m2.*got " + repr(repr(bad))[1:-1]):
        EngineArgs(kv_cache_dtype=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_cache_dtype(str(bad), "float32")


def test_the_cli_flag_takes_vllms_values_only(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = engine_args_from(parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"]), parser)
    assert args.kv_cache_dtype == "fp8_e5m2"
    assert engine_args_from(parser.parse_args([]), parser).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "float16"])
    assert "invalid choice: 'float16'" in capsys.readouterr().err


def test_a_cache_dtype_the_device_cannot_hold_is_refused_at_build(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As on an A100 (compute capability 8.0): the kernel's own check of the device, and the
    engine's error naming what to change (no silent float cache)."""
    def on_an_a100(impl: str, *, kv_cache_dtype: object, **shapes: int) -> None:
        gpu.check_cache_dtype(kv_cache_dtype, "8.0")

    monkeypatch.setattr(build, "check_supported", on_an_a100)
    cfg = ModelConfig.tiny()
    with pytest.raises(ValueError, match=r"cannot hold a float8_e4m3fn KV cache on this "
                                         r"device: .*float8_e5m2 on compute capability 8.0.*"
                                         r"Set kv_cache_dtype") as e:
        build.attention_backend(EngineArgs(kv_cache_dtype="fp8"), cfg)
    assert isinstance(e.value.__cause__, UnsupportedShapeError)
    assert build.attention_backend(EngineArgs(kv_cache_dtype="fp8_e5m2"), cfg)


def _engine(**kw: object):  # noqa: ANN202 (an LLMEngine)
    return build_engine(EngineArgs(**{"model": TINY, "skip_tokenizer_init": True,
                                      "block_size": 4, "max_model_len": 64,
                                      "attention_backend": "reference", **kw}))


@pytest.mark.parametrize(("kv_cache_dtype", "dtype", "itemsize"), [
    ("auto", "float32", 4), ("bfloat16", "bfloat16", 2), ("fp8", "float8_e4m3fn", 1),
    ("fp8_e5m2", "float8_e5m2", 1)])
def test_the_pool_is_made_in_the_dtype_and_sized_by_its_bytes(
        kv_cache_dtype: str, dtype: str, itemsize: int, caplog: pytest.LogCaptureFixture
) -> None:
    budget = 100 * VALUES_PER_BLOCK * 4  # 100 float32 blocks
    with caplog.at_level(logging.INFO, logger="jaxengine.engine"):
        engine = _engine(kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=budget)
    assert f"KV cache: {400 // itemsize} blocks of 4 tokens in {dtype}" in caplog.text
    # fp8 is stored as its bits on the CPU path (jaxengine_kernels.cache_dtype.storage_dtype)
    assert engine.runner.kv.dtype == (jnp.uint8 if itemsize == 1 else jnp.dtype(dtype))
    assert engine.config.cache.kv_cache_dtype == dtype
    assert engine.config.cache.kv_bytes_per_block == VALUES_PER_BLOCK * itemsize
    # The same budget: 100 float32 blocks, 200 bfloat16, 400 fp8.
    assert engine.config.scheduler.num_blocks == 100 * 4 // itemsize
    assert engine.runner.kv.nbytes == engine.config.scheduler.num_blocks * VALUES_PER_BLOCK \
        * itemsize


def test_a_grouped_pool_takes_the_dtype_too() -> None:
    engine = build_engine(EngineArgs(
        model="tests/fixtures/tiny/gemma3_text", skip_tokenizer_init=True, block_size=4,
        max_model_len=64, attention_backend="reference", kv_cache_dtype="fp8_e5m2",
        num_gpu_blocks_override=60))
    assert len(engine.config.scheduler.kv_cache_groups) > 1  # sliding and full layers
    assert engine.runner.kv.dtype == jnp.uint8  # float8_e5m2's bits, on the CPU path


def test_auto_follows_the_models_dtype() -> None:
    engine = _engine(dtype="bfloat16", num_gpu_blocks_override=20)
    assert engine.runner.kv.dtype == jnp.bfloat16


def _cache_info(llm: LLM) -> list[Gauge]:
    return [m for m in llm.get_metrics() if m.name == "jaxengine:cache_config_info"]


def test_the_cache_config_info_gauge_has_vllms_labels() -> None:
    engine = make_engine(num_blocks=50, kv_cache_dtype="fp8", block_size=4)
    (info,) = _cache_info(LLM.from_engine(engine))
    assert isinstance(info, Gauge) and info.value == 1
    assert info.labels == {
        "block_size": "4", "gpu_memory_utilization": "0.9", "cache_dtype": "fp8",
        "num_gpu_blocks_override": "None", "enable_prefix_caching": "True",
        "kv_cache_memory_bytes": "None", "kv_offloading_size": "None",
        "num_gpu_blocks": "50", "num_cpu_blocks": "0"}
    text = LLM.from_engine(make_engine())._metrics.render().decode()  # as /metrics serves it
    (line,) = [ln for ln in text.splitlines() if ln.startswith("jaxengine:cache_config_info{")]
    assert 'cache_dtype="auto"' in line and 'engine="0"' in line and line.endswith(" 1.0")


def test_num_cpu_blocks_is_the_offloading_stores_pages() -> None:
    # the fake model's pages are 4 int32 slots (16 bytes); 1e-6 GiB holds 67 of them
    engine = make_engine(kv_offloading_size=1e-6)
    (info,) = _cache_info(LLM.from_engine(engine))
    assert info.labels["num_cpu_blocks"] == "67" and info.labels["kv_offloading_size"] == "1e-06"


def test_the_servers_metrics_have_the_gauge() -> None:
    server = AsyncEngine(make_engine(kv_cache_dtype="fp8_e5m2"), model_name="m", log_interval=0)
    text = server.metrics.render().decode()  # what /metrics serves
    assert _value(text, "jaxengine:cache_config_info", cache_dtype="fp8_e5m2", engine="0") == 1


def test_replicas_of_one_config_read_as_one_series() -> None:
    llm = LLM.from_engine(DataParallelEngine([make_engine(), make_engine()]))
    (info,) = _cache_info(llm)
    assert info.value == 1 and "engine" not in info.labels
    text = llm._metrics.render().decode()
    assert text.count("jaxengine:cache_config_info{") == 2  # one per replica


def test_an_fp8_pool_of_the_cpu_kernel_is_its_bits_and_says_fp8() -> None:
    """Stored as uint8 (XLA on CPU scatters into it in place), counted and reported as the
    fp8 cache the user asked for."""
    engine = _engine(kv_cache_dtype="fp8", attention_backend="cpu", num_gpu_blocks_override=20)
    assert engine.runner.kv.dtype == jnp.uint8
    assert engine.config.cache.kv_cache_dtype == "float8_e4m3fn"
    assert engine.config.cache.kv_bytes_per_block == VALUES_PER_BLOCK  # one byte a value
    (info,) = _cache_info(LLM.from_engine(engine))
    assert info.labels["cache_dtype"] == "fp8" and info.labels["num_gpu_blocks"] == "20"
