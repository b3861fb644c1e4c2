"""The attention kernel on the device: correct against the jnp reference on garbage-filled
caches, present in the engine's compiled step, and timed against the reference."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import attention as bench
from benchmarks.device_sections.context import PAGE_SIZE, Context, report
from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import attention_backend, model_fns
from jaxengine.model.config import ModelConfig
from jaxengine.model.decoder import Model
from jaxengine.model.kv_cache import kv_cache_shape, kv_cache_sharding
from jaxengine.model.mesh import TP_AXIS
from jaxengine.model.step import pack_batch
from jaxengine.runner.programs import jaxengine_model_step
from jaxengine_kernels import check_supported, ragged_paged_attention
from tests.jaxengine_kernels.cases import make_case

HEADS = {"llama3-8b": (32, 8, 128), "smollm2": (9, 3, 64), "smoke": (4, 2, 64)}  # N, K, H
BATCHES = {  # (q_len, context_len) per request
    "decode": [(1, 3000), (1, 17), (1, 1), (1, 900), (1, 257)],
    "prefill": [(200, 200), (37, 37), (64, 64)],
    "mixed": [(1, 33), (96, 96), (40, 700), (1, 2), (3, 16)],
    "long": [(1, 8000), (128, 4000), (1, 1500)],
}
SMOKE_BATCHES = {"decode": [(1, 40), (1, 17), (1, 1)], "mixed": [(1, 33), (20, 20), (9, 40)]}
GARBAGE = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}
TOL = {"float32": 1e-4, "bfloat16": 5e-2}
SMOKE_SHAPES = [
    bench.Shape(name=name, num_decodes=d, num_prefills=p, chunk=16, context=(16, 64),
                num_heads=4, num_kv_heads=2, head_dim=64, page_size=PAGE_SIZE)
    for name, d, p in (("decode", 3, 0), ("mixed", 2, 1))
]  # fmt: skip
CUSTOM_CALL = {"gpu": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
KERNEL_NAME = {"gpu": "ragged_paged_attention_gpu", "tpu": "ragged_paged_attention_tpu"}
FALLBACK = "ragged_paged_attention_reference"  # the jitted reference's name in the HLO
# The CPU smoke lowers the engine step for these abstract devices: (lowering platform, kind).
ABSTRACT_DEVICES = {"gpu": ("cuda", "NVIDIA H200"), "tpu": ("tpu", "TPU v6 lite")}


# ---- correctness ----------------------------------------------------------------------------


def _grid(ctx: Context) -> list[tuple[str, str, str, str]]:
    """(batch, heads, dtype, garbage) runs; the garbage value cycles so that all three appear."""
    if ctx.smoke:
        return [(b, "smoke", "float32", g) for b in SMOKE_BATCHES for g in ("nan", "+inf")]
    batches = ("mixed", "long") if ctx.quick else tuple(BATCHES)
    heads = ("llama3-8b",) if ctx.quick else ("llama3-8b", "smollm2")
    runs = [(b, h, d) for b in batches for h in heads for d in ("bfloat16", "float32")]
    return [(*run, tuple(GARBAGE)[i % len(GARBAGE)]) for i, run in enumerate(runs)]


def correctness(ctx: Context) -> list[str]:
    """Each kernel vs the reference on garbage-filled caches; finite and within tolerance."""
    failures = []
    for i, (batch, heads, dtype, garbage) in enumerate(_grid(ctx)):
        N, K, H = HEADS[heads]
        reqs = (SMOKE_BATCHES if ctx.smoke else BATCHES)[batch]
        case = make_case(reqs, num_heads=N, num_kv_heads=K, head_dim=H, page_size=PAGE_SIZE,
                         garbage=GARBAGE[garbage], seed=i)  # fmt: skip
        args, T = case.args(jnp.dtype(dtype)), case.num_tokens
        ref, _ = ragged_paged_attention(*args, sm_scale=case.sm_scale, impl="reference")
        ref = np.asarray(ref[:T].astype(jnp.float32))
        for impl in ctx.impls:
            out, _ = ragged_paged_attention(*args, sm_scale=case.sm_scale, impl=impl,
                                            interpret=ctx.interpret)  # fmt: skip
            out = np.asarray(out[:T].astype(jnp.float32))
            err = float(np.abs(out - ref).max())
            ok = bool(np.isfinite(out).all() and np.isfinite(ref).all()) and err <= TOL[dtype]
            report("correctness", f"{impl} {batch:7} {heads:9} {dtype:8} garbage={garbage:4} "
                    f"max|err| {err:.2e} (tol {TOL[dtype]:.0e})", ok)  # fmt: skip
            if not ok:
                failures.append(f"correctness {impl} {batch} {heads} {dtype} {garbage}")
    return failures


# ---- the engine's compiled step -------------------------------------------------------------


def engine_step(cfg: ModelConfig, impl: str, dtype: jnp.dtype, mesh: Any = None
                 ) -> tuple[Callable, tuple, dict]:
    """The step program the engine runs: ``model_fns`` over the model, jitted like the runner.

    Args:
        mesh: an ``AbstractMesh`` (of an abstract device) to trace the model on, weights
            abstract; default: a real model on this machine's first device.
    Returns ``(jitted, args, statics)`` for ``jitted.lower(*args, **statics)``.
    """
    if mesh is None:
        model = Model(cfg, dtype=dtype, seed=0)
    else:
        model = nnx.eval_shape(lambda: Model(cfg, dtype=dtype, seed=0, mesh=mesh))
    fns = model_fns(model, cfg, attn_impl=impl)
    shape = kv_cache_shape(cfg, num_blocks=64, block_size=PAGE_SIZE,
                           num_kv_heads=model.layout.num_kv_heads)
    kv = jax.ShapeDtypeStruct(shape, dtype, sharding=kv_cache_sharding(model.mesh))
    batch = pack_batch([], num_tokens=64, max_seqs=8, max_blocks=8, block_size=PAGE_SIZE)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    prev_tokens = jax.ShapeDtypeStruct((8,), np.int32)  # the last step's tokens, i32[R]
    fill = jax.ShapeDtypeStruct((64,), np.int32)  # no placeholders: all -1
    # As jaxengine.runner.runner jits it: the model function static, the cache donated.
    jitted = jax.jit(jaxengine_model_step, static_argnames=("step_fn",), donate_argnames=("kv",))
    return jitted, (fns.params, kv, batch, prev_tokens, fill), {"step_fn": fns.step}


def lowered_for_abstract_device(impl: str, cfg: ModelConfig) -> str:
    """The engine step lowered on CPU for an abstract accelerator (no compile possible)."""
    # Imported here: only the CPU smoke uses them, and the device's jax (older than this
    # machine's) must not fail at import over a name it never needs.
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    platform, kind = ABSTRACT_DEVICES[impl]
    device = AbstractDevice(device_kind=kind, num_cores=1,
                            platform=platform.replace("cuda", "gpu"))  # fmt: skip
    # The engine's own 1-device mesh (axis "tp", Auto), on the abstract device.
    mesh = AbstractMesh((1,), (TP_AXIS,), (AxisType.Auto,), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        jitted, args, statics = engine_step(cfg, impl, jnp.float32, mesh=mesh)
        return jitted.trace(*args, **statics).lower(lowering_platforms=(platform,)).as_text()


def check_text(impl: str, stage: str, text: str, *, require_call: bool) -> bool:
    """Report whether ``text`` holds the kernel's custom call and not the reference."""
    calls, named = text.count(CUSTOM_CALL[impl]), text.count(KERNEL_NAME[impl])
    fallback = text.count(FALLBACK)
    # Compiled HLO may rename the custom call; the kernel's name survives in its metadata.
    ok = (calls > 0 if require_call else calls + named > 0) and fallback == 0
    report("engine-hlo", f"{impl} {stage}: {CUSTOM_CALL[impl]} "
            f"{'found x' + str(calls) if calls else 'NOT FOUND'}, {KERNEL_NAME[impl]} named "
            f"x{named}, reference {'FOUND x' + str(fallback) if fallback else 'not found'}",
            ok)  # fmt: skip
    return ok


def engine_hlo(ctx: Context) -> list[str]:
    """The engine's step contains the Pallas kernel's custom call, not the jnp reference."""
    if ctx.smoke:
        cfg = ModelConfig.tiny(hidden_size=64, head_dim=64)
        failures = []
        for impl in ctx.impls:
            N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
            check_supported(impl, num_heads=N, num_kv_heads=K, head_dim=H, page_size=PAGE_SIZE)
            text = lowered_for_abstract_device(impl, cfg)
            if not check_text(impl, "lowered (abstract device)", text, require_call=True):
                failures.append(f"engine-hlo {impl}")
        return failures
    cfg = ModelConfig.smollm2_135m()
    impl = attention_backend(EngineArgs(block_size=PAGE_SIZE), cfg)
    if impl == "reference":
        report("engine-hlo", f"the engine chose attention_backend={impl!r}", False)
        return ["engine-hlo: the engine chose the reference"]
    jitted, args, statics = engine_step(cfg, impl, jnp.bfloat16)
    lowered = jitted.lower(*args, **statics)
    ok = check_text(impl, "lowered", lowered.as_text(), require_call=True)
    t0 = time.perf_counter()
    compiled = lowered.compile().as_text()
    report("engine-hlo", f"compiled the SmolLM2-135M step in {time.perf_counter() - t0:.1f}s")
    ok &= check_text(impl, "compiled", compiled, require_call=False)
    return [] if ok else [f"engine-hlo {impl}"]


# ---- timing and bandwidth -------------------------------------------------------------------


def timing(ctx: Context) -> list[str]:
    """Median time of each kernel and the reference; KV bytes read per second vs the peak."""
    failures = []
    shapes = SMOKE_SHAPES if ctx.smoke else bench.FULL
    for shape in shapes:
        batch = bench.make_batch(shape, jnp.dtype("bfloat16"))
        ref_t, ref_out = bench.time_impl("reference", batch, ctx.iters, interpret=False)
        kv_bytes = bench.kv_read_bytes(batch)
        for impl in ctx.impls:
            t, out = bench.time_impl(impl, batch, ctx.iters, interpret=ctx.interpret)
            err = bench.live_error(out, ref_out, batch)
            ok = bool(np.isfinite(err)) and err <= TOL["bfloat16"]
            report("timing", f"{shape.name:6} {impl}: {t * 1e3:.3f} ms, reference "
                    f"{ref_t * 1e3:.3f} ms: {ref_t / t:.2f}x (max|err| {err:.1e})", ok)
            gbps = kv_bytes / t / 1e9
            report("bandwidth", f"{shape.name:6} {impl}: {kv_bytes / 1e6:.1f} MB of KV in "
                    f"{t * 1e3:.3f} ms = {gbps:.1f} GB/s = {100 * gbps / ctx.peak_gbps:.1f}% "
                    f"of {ctx.peak_gbps:.0f} GB/s")  # fmt: skip
            if not ok:
                failures.append(f"timing {shape.name} {impl}")
    return failures

