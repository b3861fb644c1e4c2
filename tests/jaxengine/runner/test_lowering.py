"""The accelerator path, lowered on this CPU-only machine for devices it lacks.

Each program is traced on an `AbstractMesh` of abstract TPU v6e or H200 devices (the engine's
axis "tp", Auto) over weights made abstractly (`nnx.eval_shape`: nothing is allocated), then
lowered with `lowering_platforms=` (no compile: that needs the device). Checked in the
lowered module: the Pallas kernel's custom call is there, the jnp reference is not, and under
tensor parallelism the explicit collectives and the shardings that imply the others are what
docs/DESIGN.md ("Scale out") says; docs/JAX_NOTES.md ("Lowering for absent devices") says
which collectives appear only at compile.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding, PartitionSpec

from jaxengine.engine.build import model_fns
from jaxengine.fixed_batch.generate import STATIC, jaxengine_generate
from jaxengine.fixed_batch.programs import program_for
from jaxengine.fixed_batch.score import jaxengine_score
from jaxengine.loading.hf import read_hf_config
from jaxengine.model.batch import pack_batch
from jaxengine.model.config import ModelConfig
from jaxengine.model.decoder import Model
from jaxengine.model.fns import ModelFns
from jaxengine.model.kv_cache import kv_cache_sharding
from jaxengine.model.mesh import TP_AXIS
from jaxengine.model.tensor_parallel import tp_layout
from jaxengine.runner.programs import programs_for
from jaxengine.sampling.logits_processors import build_adjustments
from jaxengine.sampling.request_tables import init_tables
from jaxengine.sampling.rows import MAX_BANNED, build_sampling_metadata
from jaxengine.structured.bitmask import bitmask_width
from jaxengine_kernels import check_supported

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny"
# attention_backend -> (lowering platform, abstract device kind, the kernel's custom call)
ACCELERATORS = {"tpu": ("tpu", "TPU v6 lite", "tpu_custom_call"),
                "gpu": ("cuda", "NVIDIA H200", "__gpu$xla.gpu.triton")}
REFERENCE = "ragged_paged_attention_reference"  # the jitted jnp reference's function name
T, R, BLOCK, PAGES = 64, 8, 16, 64  # a prefill+decode bucket: T tokens of R requests
MAX_LOGPROBS = 20  # EngineArgs' default: the step's prompt-logprobs output is in the program
# A Llama-shaped tiny model that tp=4 splits (KV heads repeated: K=2 < tp).
LLAMA_TP4 = ModelConfig.tiny(num_heads=8, num_kv_heads=2, hidden_size=64, head_dim=64,
                             vocab_size=100)


def _mesh(impl: str, tp: int) -> AbstractMesh:
    platform, kind, _ = ACCELERATORS[impl]
    device = AbstractDevice(device_kind=kind, num_cores=1, platform=platform.replace("cuda",
                                                                                     "gpu"))
    return AbstractMesh((tp,), (TP_AXIS,), (AxisType.Auto,), abstract_device=device)


def _fns(cfg: ModelConfig, mesh: AbstractMesh, impl: str, *, quantization: str | None = None,
         kv_cache_dtype: Any = None) -> tuple[ModelFns, Any]:
    """The engine's `ModelFns` (as `build_engine` makes them) over abstract bf16 weights, and
    the KV pool's abstract array (the runner's: the groups' layout)."""
    if impl != "reference":  # as `build.attention_backend` checks it, on one device's heads
        check_supported(impl, num_heads=cfg.num_heads // mesh.size, head_dim=cfg.head_dim,
                        num_kv_heads=tp_layout(cfg, mesh.size).kv_heads_per_device,
                        page_size=BLOCK)
    model = nnx.eval_shape(lambda: Model(cfg, dtype=jnp.bfloat16, mesh=mesh,
                                         quantization=quantization))
    fns = model_fns(model, cfg, attn_impl=impl, kv_cache_dtype=kv_cache_dtype)
    init = fns.init_group_kv if len(fns.kv_cache_groups) > 1 else fns.init_kv
    kv = jax.eval_shape(lambda: init(PAGES, BLOCK))  # its sharding is not traced through
    return fns, jax.ShapeDtypeStruct(kv.shape, kv.dtype, sharding=kv_cache_sharding(mesh))


def _spec(x: Any, sharding: NamedSharding | None = None) -> jax.ShapeDtypeStruct:
    x = np.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def lower_engine_step(cfg: ModelConfig, impl: str, tp: int, **precision: Any
                      ) -> tuple[str, str, ModelFns]:
    """The runner's two programs (model step, then sampler) for a T-token bucket, lowered for
    `impl`'s accelerator on a tp-device mesh: (step text, sampler text, the model's fns)."""
    platform = ACCELERATORS[impl][0]
    mesh = _mesh(impl, tp)
    with jax.sharding.use_abstract_mesh(mesh):
        fns, kv = _fns(cfg, mesh, impl, **precision)
        programs = programs_for(fns)
        replicated = NamedSharding(mesh, PartitionSpec())
        batch = jax.tree.map(_spec, pack_batch([], num_tokens=T, max_seqs=R, max_blocks=8,
                                               block_size=BLOCK,
                                               num_groups=len(fns.kv_cache_groups)))
        prev = jax.ShapeDtypeStruct((R,), np.int32, sharding=replicated)  # the last tokens
        fill = jax.ShapeDtypeStruct((T,), np.int32)  # placeholders, and prompt targets
        step = programs.step.trace(fns.params, kv, batch, prev, fill, fill,
                                   max_logprobs=MAX_LOGPROBS)
        hidden = step.out_info[1]
        tables = init_tables(R, fns.vocab_size)
        sample = programs.sample.trace(
            fns.params, jax.ShapeDtypeStruct(hidden.shape, hidden.dtype, sharding=replicated),
            _spec(np.zeros(R, np.int32)),
            jax.tree.map(_spec, build_sampling_metadata([], R, max_banned=MAX_BANNED)),
            jax.tree.map(_spec, build_adjustments([], [], [], [], R)),
            *(_spec(x, replicated) for x in (tables.bias, tables.prompt_mask,
                                             tables.output_counts)),
            prev, _spec(np.zeros((R, bitmask_width(fns.vocab_size)), np.int32), replicated),
            max_logprobs=MAX_LOGPROBS, num_rows=R, token_sharding=replicated)
        lower = dict(lowering_platforms=(platform,))
        return (step.lower(**lower).as_text(), sample.lower(**lower).as_text(), fns)


def assert_kernel_not_reference(text: str, impl: str) -> None:
    assert ACCELERATORS[impl][2] in text, f"no {impl} kernel custom call"
    assert REFERENCE not in text, "the step fell back to the jnp reference"


def _main_signature(text: str) -> str:
    return next(line for line in text.splitlines() if "func.func public @main" in line)


def assert_tensor_parallel(step: str, sample: str, fns: ModelFns, cfg: ModelConfig,
                           tp: int) -> None:
    """The design's collectives, as far as lowering shows them (docs/JAX_NOTES.md): the
    explicit psums (the vocab-parallel embedding's, and the experts' inside the scanned layer
    body), no all-gather in the step; the weights arrive split over "tp" (their row-parallel
    products' all-reduces come from that at compile), the KV cache split on heads in and out,
    and the sampler's logits constrained whole (the vocab-parallel head's all-gather)."""
    assert step.count("stablehlo.all_reduce") == 1 + bool(cfg.num_experts)
    assert "all_gather" not in step and "all_to_all" not in step
    split = sum(TP_AXIS in (leaf.sharding.spec if leaf.sharding else ())
                for leaf in jax.tree.leaves(fns.params))
    main = _main_signature(step)
    args = main.split(") -> (")[0].split("%arg")[1:]
    assert split > 0 and sum('{"tp"}' in a for a in args) == split + 1  # the weights, the cache
    heads_split = '<@mesh, [{}, {}, {}, {"tp"}, {}]>'  # [Ly, P, L, 2K, H]
    assert main.count(heads_split) == 1  # the cache's argument; the cache it returns:
    assert re.search(r"sdy\.sharding_constraint %\S+ " + re.escape(heads_split), step)
    V = tp_layout(cfg, tp).vocab_size  # V', padded to a multiple of tp
    assert f"<@mesh, [{{}}, {{}}]> : tensor<{R}x{V}xf32>" in sample


DEFAULT_MODEL = ModelConfig.smollm2_135m()


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize(("cfg", "tp"), [(DEFAULT_MODEL, 1), (DEFAULT_MODEL, 3),
                                         (LLAMA_TP4, 4)],
                         ids=["smollm2-tp1", "smollm2-tp3", "llama-tiny-tp4"])
def test_engine_step_lowers_with_the_kernel(cfg: ModelConfig, tp: int, impl: str) -> None:
    # SmolLM2-135M has 9 query heads: tp 1 and 3 are its only splits (tp=4 is refused), so
    # tp=4 runs a Llama-shaped tiny model whose 2 KV heads are repeated to 4.
    step, sample, fns = lower_engine_step(cfg, impl, tp)
    assert_kernel_not_reference(step, impl)
    assert f"mhlo.num_partitions = {tp}" in step
    if tp > 1:
        assert_tensor_parallel(step, sample, fns, cfg, tp)


def _family(name: str) -> ModelConfig:
    # The kernels need head_dim a multiple of 64 (TPU): the fixtures' 16 is widened.
    return dataclasses.replace(read_hf_config(TINY / name), head_dim=64)


FAMILIES = ["gemma2_softcap", "gemma3_text", "mixtral_moe", "qwen2_moe", "qwen2_bias_tied"]


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_lowers_at_tp2(family: str, impl: str) -> None:
    cfg = _family(family)
    step, sample, fns = lower_engine_step(cfg, impl, 2)
    assert_kernel_not_reference(step, impl)
    assert_tensor_parallel(step, sample, fns, cfg, 2)
    if cfg.num_experts:
        assert "ragged_dot" in step  # the grouped expert matmul, not a dense loop


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("precision", [dict(quantization="int8"), dict(quantization="fp8"),
                                       dict(kv_cache_dtype=jnp.float8_e4m3fn)],
                         ids=["int8-weights", "fp8-weights", "fp8-kv"])
def test_each_precision_lowers(precision: dict, impl: str) -> None:
    step, _, _ = lower_engine_step(LLAMA_TP4, impl, 1, **precision)
    assert_kernel_not_reference(step, impl)
    dtype = "i8" if precision.get("quantization") == "int8" else "f8E4M3FN"
    main = _main_signature(step)
    if "quantization" in precision:  # the weights arrive quantized
        assert f"x{dtype}>" in main
    else:  # the pool is fp8, and the kernel is what writes it
        assert f"x{LLAMA_TP4.head_dim}x{dtype}>" in main
    # TPU v6e and H200 multiply fp8: fp8 weights meet fp8 activations in the projections
    fp8_dot = re.compile(r"dot_general .*\(tensor<[^>]*xf8E4M3FN>, tensor<[^>]*xf8E4M3FN>\)")
    assert bool(fp8_dot.search(step)) == (precision.get("quantization") == "fp8")


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("program", ["generate", "score"])
def test_generate_and_score_lower_with_the_kernel(program: str, impl: str) -> None:
    platform = ACCELERATORS[impl][0]
    mesh = _mesh(impl, 2)
    B, S, N = 2, 8, 4
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)  # noqa: E731
    f32 = jax.ShapeDtypeStruct((B,), np.float32)
    with jax.sharding.use_abstract_mesh(mesh):
        fns, _ = _fns(LLAMA_TP4, mesh, impl)
        layout = dict(cache="paged", block_size=BLOCK)
        if program == "generate":
            traced = program_for(jaxengine_generate, fns, static_argnames=STATIC).trace(
                fns.params, i32(B, S), i32(B), jax.ShapeDtypeStruct((B,), np.uint32), f32,
                i32(B), f32, f32, i32(1), i32(), max_new_tokens=N, logprobs=2, **layout)
        else:
            traced = program_for(jaxengine_score, fns, static_argnames=tuple(layout)).trace(
                fns.params, i32(B, S), i32(B, N), i32(B), i32(B), **layout)
        text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert_kernel_not_reference(text, impl)
    # generate: the prefill and the decode loop's step each call the kernel
    assert text.count(ACCELERATORS[impl][2]) >= (2 if program == "generate" else 1)


def test_the_reference_marker_is_what_a_reference_step_lowers_to() -> None:
    # The checks above would pass vacuously if the reference never showed its name: it does.
    mesh = _mesh("tpu", 1)
    with jax.sharding.use_abstract_mesh(mesh):
        fns, kv = _fns(LLAMA_TP4, mesh, "reference")
        batch = jax.tree.map(_spec, pack_batch([], num_tokens=T, max_seqs=R, max_blocks=8,
                                               block_size=BLOCK))
        text = programs_for(fns).step.trace(
            fns.params, kv, batch, _spec(np.zeros(R, np.int32)), _spec(np.zeros(T, np.int32)),
            max_logprobs=0).lower(lowering_platforms=("tpu",)).as_text()
    assert REFERENCE in text and ACCELERATORS["tpu"][2] not in text
