"""Choosing the attention backend at engine build: the platform must match, and a Pallas kernel
must run the model's shapes; an unsupported shape is an error at build, never a silent switch
to the jnp reference at trace time."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import attention_backend, build_engine
from jaxengine.model.config import ModelConfig
from jaxengine.model.decoder import Model
from jaxengine.model.step import RequestChunk, make_model_step, pack_batch, split_model
from jaxengine_kernels import UnsupportedShapeError, cpu, default_impl

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny" / "llama_tied_mha"  # head_dim 8
KERNEL_OK = ModelConfig.tiny(hidden_size=64, head_dim=64)  # shapes both kernels accept


def test_the_backend_is_checked_against_the_platform() -> None:
    assert attention_backend(EngineArgs(), KERNEL_OK) == "cpu"  # CPU: the native kernel
    assert attention_backend(EngineArgs(attention_backend="reference"), KERNEL_OK) == "reference"
    with pytest.raises(ValueError, match="attention_backend='tpu' needs a TPU"):
        attention_backend(EngineArgs(attention_backend="tpu"), KERNEL_OK)
    with pytest.raises(ValueError, match="must be one of"):
        EngineArgs(attention_backend="cuda-fast")


def test_one_function_maps_platforms_to_kernels() -> None:
    # jax names CUDA and ROCm devices "gpu"; the engine's default is exactly this mapping
    assert [default_impl(p) for p in ("tpu", "gpu", "cpu")] == ["tpu", "gpu", "cpu"]
    assert attention_backend(EngineArgs(), KERNEL_OK) == default_impl()


@pytest.mark.parametrize(("impl", "rule"), [("tpu", "a multiple of 64"), ("gpu", ">= 16")])
def test_building_an_engine_on_a_kernel_that_rejects_the_model_is_an_error(impl: str,
                                                                          rule: str) -> None:
    with pytest.raises(ValueError) as e:
        build_engine(EngineArgs(model=str(TINY), attention_backend=impl, block_size=16,
                                num_gpu_blocks_override=64, max_model_len=128))
    message = str(e.value)
    assert f"attention_backend={impl!r} cannot run this model" in message
    assert "num_heads=4, num_kv_heads=4, head_dim=8, block_size=16" in message
    assert f"head_dim must be {rule}" in message and "got 8" in message
    assert 'Set attention_backend="reference" to run the jnp reference instead' in message
    assert isinstance(e.value.__cause__, UnsupportedShapeError)


@pytest.mark.parametrize(("impl", "block_size"), [("tpu", 12), ("gpu", 24)])
def test_a_block_size_the_kernel_rejects_names_block_size(impl: str, block_size: int) -> None:
    args = EngineArgs(attention_backend=impl, block_size=block_size)
    with pytest.raises(ValueError, match=f"page_size must be .*got {block_size}") as e:
        attention_backend(args, KERNEL_OK)
    assert f"block_size={block_size}" in str(e.value)
    assert 'attention_backend="reference"' in str(e.value)
    assert "or use a block_size it accepts" in str(e.value)


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_the_reference_and_the_cpu_kernel_run_any_shape(impl: str) -> None:
    cfg = ModelConfig.tiny(head_dim=8)
    assert attention_backend(EngineArgs(attention_backend=impl, block_size=3), cfg) == impl


def test_an_explicit_cpu_kernel_that_cannot_be_built_is_an_error(monkeypatch) -> None:
    monkeypatch.setattr(cpu, "available", lambda: "no C++ compiler found")
    with pytest.raises(ValueError, match="needs the native CPU kernel.*no C\\+\\+ compiler"):
        attention_backend(EngineArgs(attention_backend="cpu"), KERNEL_OK)


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_a_kernel_step_on_an_unsupported_shape_raises_instead_of_falling_back(impl: str) -> None:
    cfg = ModelConfig.tiny(head_dim=8)
    # An abstract model (nnx.eval_shape): the kernel refuses the shapes while tracing.
    graphdef, state = split_model(nnx.eval_shape(lambda: Model(cfg, seed=0)))
    step = jax.jit(make_model_step(graphdef, attn_impl=impl, interpret=True))
    kv = jnp.zeros((cfg.num_layers, 4, 8, 2 * cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    chunk = RequestChunk(token_ids=list(range(1, 6)), start=0, block_table=[1])
    batch = pack_batch([chunk], num_tokens=8, max_seqs=2, max_blocks=2, block_size=8)
    with pytest.raises(UnsupportedShapeError, match="head_dim") as e:
        step.trace(state, kv, batch)
    assert e.value.value == 8
