"""One prepared check for a lent accelerator (NVIDIA H200, or a TPU): is the Pallas attention
kernel correct there, is it what the engine's compiled step runs, and how fast is it?

    python benchmarks/device_check.py [--quick] [--peak-gbps 4800] [--iters 20]
    python benchmarks/device_check.py --cpu-smoke    # CPU: interpret mode, tiny sizes

Sections, in order; each prints lines tagged with its name:
  correctness  the kernel against the jnp reference, both on the device, over a small grid of
               batches x head shapes x dtypes, with NaN / +Inf / -Inf garbage in every KV slot
               no query may attend to (``tests/jaxengine_kernels/cases.py``): max |kernel - ref|.
  engine-hlo   the engine's step (``model_fns`` with ``attention_backend(...)``, as
               ``build_engine`` makes them, jitted like the runner's) lowered and compiled: the
               Triton / Mosaic custom call must be in it and the jnp reference must not.
  timing       kernel vs reference, median ms (``benchmarks/attention.py``'s batches and timer);
  bandwidth    from the same runs: bytes of cached KV read / kernel time / ``--peak-gbps``.
  tensor-parallel  the engine's decode step (model step + greedy sampler, as the runner jits
               them) at tp = 1, 2, 4, 8 over the first tp devices, on a Llama-3-8B-shaped
               random bf16 model: median ms, and the bytes one device reads per step (its
               weight shards and its share of the KV cache) / step time / ``--peak-gbps``, the
               fraction of the HBM roofline. A tp larger than the device count is skipped.
  weights      the same decode step at tp=1 with bf16, int8 and fp8 weights (bf16 activations,
               ``quantization=``) and with bf16 weights over an fp8 KV cache
               (``kv_cache_dtype="fp8"``): median ms, weight and KV bytes, fraction of the HBM
               roofline, and how many greedy tokens equal bf16's.
  families     a Gemma-3-1B-shaped model (5 local : 1 global layers, window 512) and a
               Mixtral-shaped one (8 of its layers, 8 experts, top-2), random bf16: the
               kernel's custom call (and the experts' ragged_dot) in the compiled step, the
               decode step at context 8 x window: median ms and bytes read / time / peak.
  first-token  seconds from process start to the first generated token: a fresh subprocess
               imports jaxengine, builds ``LLM()`` over the default model (precompiled) and
               generates one token for a short prompt; cold (an empty compilation cache) then
               warm (the cache the cold run filled), with the imports / ``LLM()`` / generate
               split. A figure against the 5 s warm target, no threshold.
It ends with ``summary: PASS`` or ``summary: FAIL (...)`` and exits 1 on any failure; a section
that raises is a failure, and the later sections still run.

``--cpu-smoke`` runs every section on CPU: both kernels in interpret mode at tiny sizes, the
engine step lowered (not compiled) for an abstract H200 and TPU v6e, and tensor parallel on 4
virtual CPU devices (tp=8 skipped) with a tiny model, and the first token with the tiny
fixture model. Its timings mean nothing; it exists so that a test keeps this script from
rotting between device runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SMOKE_DEVICES = 4  # virtual CPU devices of the smoke run, so that tp > 1 runs on CPU too
if "--cpu-smoke" in sys.argv and "device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +  # before jax is imported
                               f" --xla_force_host_platform_device_count={SMOKE_DEVICES}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import attention as bench  # noqa: E402
from jaxengine.engine.args import EngineArgs  # noqa: E402
from jaxengine.engine.build import attention_backend, model_fns  # noqa: E402
from jaxengine.loading.load import tiny_model_path  # noqa: E402
from jaxengine.model.batch import ModelBatch, RequestChunk  # noqa: E402
from jaxengine.model.config import ModelConfig  # noqa: E402
from jaxengine.model.decoder import Model  # noqa: E402
from jaxengine.model.kv_cache import kv_cache_shape, kv_cache_sharding  # noqa: E402
from jaxengine.model.mesh import TP_AXIS, make_mesh  # noqa: E402
from jaxengine.model.step import pack_batch  # noqa: E402
from jaxengine.runner.programs import jaxengine_model_step, programs_for  # noqa: E402
from jaxengine.sampling.logits_processors import build_adjustments  # noqa: E402
from jaxengine.sampling.request_tables import init_tables  # noqa: E402
from jaxengine.sampling.rows import build_sampling_metadata  # noqa: E402
from jaxengine_kernels import check_supported, default_impl, ragged_paged_attention  # noqa: E402
from tests.jaxengine_kernels.cases import make_case  # noqa: E402

PAGE_SIZE = 16
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    """What every section needs to know about this run."""

    impls: tuple[str, ...]  # kernels to check: the device's, or both in the CPU smoke
    interpret: bool  # Pallas interpret mode (CPU smoke)
    smoke: bool  # CPU smoke: tiny sizes, abstract lowering
    quick: bool  # a smaller grid and fewer timing iterations
    peak_gbps: float  # HBM peak for the bandwidth fraction
    iters: int  # timed calls per implementation


def _report(section: str, text: str, ok: bool | None = None) -> None:
    verdict = "" if ok is None else (" PASS" if ok else " FAIL")
    print(f"[{section}] {text}{verdict}", flush=True)


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
            _report("correctness", f"{impl} {batch:7} {heads:9} {dtype:8} garbage={garbage:4} "
                    f"max|err| {err:.2e} (tol {TOL[dtype]:.0e})", ok)  # fmt: skip
            if not ok:
                failures.append(f"correctness {impl} {batch} {heads} {dtype} {garbage}")
    return failures


# ---- the engine's compiled step -------------------------------------------------------------


def _engine_step(cfg: ModelConfig, impl: str, dtype: jnp.dtype, mesh: Any = None
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


def _lowered_for_abstract_device(impl: str, cfg: ModelConfig) -> str:
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
        jitted, args, statics = _engine_step(cfg, impl, jnp.float32, mesh=mesh)
        return jitted.trace(*args, **statics).lower(lowering_platforms=(platform,)).as_text()


def _check_text(impl: str, stage: str, text: str, *, require_call: bool) -> bool:
    """Report whether ``text`` holds the kernel's custom call and not the reference."""
    calls, named = text.count(CUSTOM_CALL[impl]), text.count(KERNEL_NAME[impl])
    fallback = text.count(FALLBACK)
    # Compiled HLO may rename the custom call; the kernel's name survives in its metadata.
    ok = (calls > 0 if require_call else calls + named > 0) and fallback == 0
    _report("engine-hlo", f"{impl} {stage}: {CUSTOM_CALL[impl]} "
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
            text = _lowered_for_abstract_device(impl, cfg)
            if not _check_text(impl, "lowered (abstract device)", text, require_call=True):
                failures.append(f"engine-hlo {impl}")
        return failures
    cfg = ModelConfig.smollm2_135m()
    impl = attention_backend(EngineArgs(block_size=PAGE_SIZE), cfg)
    if impl == "reference":
        _report("engine-hlo", f"the engine chose attention_backend={impl!r}", False)
        return ["engine-hlo: the engine chose the reference"]
    jitted, args, statics = _engine_step(cfg, impl, jnp.bfloat16)
    lowered = jitted.lower(*args, **statics)
    ok = _check_text(impl, "lowered", lowered.as_text(), require_call=True)
    t0 = time.perf_counter()
    compiled = lowered.compile().as_text()
    _report("engine-hlo", f"compiled the SmolLM2-135M step in {time.perf_counter() - t0:.1f}s")
    ok &= _check_text(impl, "compiled", compiled, require_call=False)
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
            _report("timing", f"{shape.name:6} {impl}: {t * 1e3:.3f} ms, reference "
                    f"{ref_t * 1e3:.3f} ms: {ref_t / t:.2f}x (max|err| {err:.1e})", ok)
            gbps = kv_bytes / t / 1e9
            _report("bandwidth", f"{shape.name:6} {impl}: {kv_bytes / 1e6:.1f} MB of KV in "
                    f"{t * 1e3:.3f} ms = {gbps:.1f} GB/s = {100 * gbps / ctx.peak_gbps:.1f}% "
                    f"of {ctx.peak_gbps:.0f} GB/s")  # fmt: skip
            if not ok:
                failures.append(f"timing {shape.name} {impl}")
    return failures


# ---- tensor parallel ------------------------------------------------------------------------

TP_SIZES = (1, 2, 4, 8)
LLAMA3_8B = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096,
                        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                        head_dim=128, rope_theta=500000.0, max_position_embeddings=8192)
TP_DECODE = (32, 1024)  # decoding requests, context tokens of each
TP_SMOKE_DECODE = (4, 32)


def _decode_batch(num_reqs: int, context: int) -> ModelBatch:
    """One new token per request at position `context - 1`, each on its own pages."""
    pages = context // PAGE_SIZE
    chunks = [RequestChunk(token_ids=[7 + r], start=context - 1,
                           block_table=list(range(1 + r * pages, 1 + (r + 1) * pages)))
              for r in range(num_reqs)]
    return pack_batch(chunks, num_tokens=max(16, num_reqs), max_seqs=num_reqs,
                      max_blocks=pages, block_size=PAGE_SIZE)


def _bytes_read(model: Model, fns: Any, num_reqs: int, context: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) one device reads in a decode step: its weight shards (less the
    embedding table, of which only a row per token is read, unless it is also the LM head)
    and its part of the requests' cached KV."""
    per_device = [x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(fns.params)]
    weights = sum(per_device)
    if model.lm_head is not None:
        weights -= model.embed[...].addressable_shards[0].data.nbytes
    kv = fns.kv_bytes_per_block(PAGE_SIZE) // PAGE_SIZE * num_reqs * context
    return weights, kv


def _time_decode(cfg: ModelConfig, tp: int, ctx: Context,
                 decode: tuple[int, int] | None = None, quantization: str | None = None,
                 kv_cache_dtype: Any = None) -> tuple[float, int, int, np.ndarray]:
    """(median seconds per decode step, weight bytes, KV bytes per device, the step's tokens)
    for `decode` = (requests, context tokens each); default the tensor-parallel section's;
    the weights bf16 or in `quantization`'s format, the KV cache in `kv_cache_dtype` (None:
    the model's)."""
    num_reqs, context = decode or (TP_SMOKE_DECODE if ctx.smoke else TP_DECODE)
    model = Model(cfg, dtype=jnp.bfloat16, seed=0, mesh=make_mesh(jax.devices()[:tp]),
                  quantization=quantization)
    fns = model_fns(model, cfg, attn_impl="reference" if ctx.smoke else default_impl(),
                    kv_cache_dtype=kv_cache_dtype)
    kv = fns.init_kv(1 + num_reqs * context // PAGE_SIZE, PAGE_SIZE)
    batch, rows = _decode_batch(num_reqs, context), np.arange(num_reqs, dtype=np.int32)
    md = build_sampling_metadata([], num_reqs)  # every row greedy
    no_tokens = np.zeros(num_reqs, np.int32)  # no placeholders to fill from the last step
    fill = np.full(len(batch.input_ids), -1, np.int32)

    adj = build_adjustments([], [], [], [], num_reqs)  # no penalties: their branch is skipped
    tables = [jax.tree.map(jnp.asarray, init_tables(num_reqs, fns.vocab_size))]

    programs = programs_for(fns)

    def step(kv: jax.Array) -> tuple[jax.Array, jax.Array]:
        kv, hidden = programs.step(fns.params, kv, batch, no_tokens, fill)
        t = tables[0]  # its output counts are donated and come back
        out, _, counts = programs.sample(fns.params, hidden, rows, md, adj, t.bias,
                                         t.prompt_mask, t.output_counts, no_tokens,
                                         max_logprobs=0, num_rows=num_reqs, token_sharding=None)
        tables[0] = dataclasses.replace(t, output_counts=counts)
        return kv, out.token_ids

    kv, tokens = step(kv)  # compile + warm-up; rewriting the same slots is idempotent
    first, times = np.asarray(tokens.addressable_data(0)), []
    for _ in range(ctx.iters):
        t0 = time.perf_counter()
        kv, tokens = step(kv)
        tokens.block_until_ready()
        times.append(time.perf_counter() - t0)
    weights, kv_bytes = _bytes_read(model, fns, num_reqs, context)
    return statistics.median(times), weights, kv_bytes, first


def tensor_parallel(ctx: Context) -> list[str]:
    """Decode step time at each tp the devices allow, as a fraction of the HBM roofline."""
    cfg = ModelConfig.tiny(num_heads=8, num_kv_heads=2, hidden_size=64, vocab_size=100) \
        if ctx.smoke else LLAMA3_8B
    count, reference = len(jax.devices()), None
    for tp in TP_SIZES:
        if tp > count:
            _report("tensor-parallel", f"tp={tp}: skipped ({count} device(s))")
            continue
        t, weights, kv_bytes, tokens = _time_decode(cfg, tp, ctx)  # the model is freed after
        reference = tokens if reference is None else reference
        gbps = (weights + kv_bytes) / t / 1e9
        same = int((tokens == reference).sum())
        _report("tensor-parallel", f"tp={tp}: decode step {t * 1e3:.2f} ms; per device "
                f"{weights / 1e6:.1f} MB weights + {kv_bytes / 1e6:.1f} MB KV = {gbps:.1f} "
                f"GB/s = {100 * gbps / ctx.peak_gbps:.1f}% of {ctx.peak_gbps:.0f} GB/s; "
                f"greedy tokens equal to tp=1's: {same}/{len(tokens)} (bf16, random weights: "
                f"near ties may flip)")
    return []  # it fails by raising: a timing has no threshold


# ---- quantized weights ----------------------------------------------------------------------


def quantized_weights(ctx: Context) -> list[str]:
    """The tensor-parallel section's decode step at tp=1 with bf16, int8 and fp8 weights (bf16
    activations), and bf16 weights over an fp8 KV cache: time, weight and KV bytes, fraction
    of the HBM roofline, greedy tokens vs bf16's."""
    cfg = ModelConfig.tiny(num_heads=8, num_kv_heads=2, hidden_size=64, vocab_size=100) \
        if ctx.smoke else LLAMA3_8B
    reference = None
    for name, quantization, kv_dtype in (("bf16", None, None), ("int8", "int8", None),
                                         ("fp8", "fp8", None),
                                         ("bf16 + fp8 KV", None, jnp.float8_e4m3fn)):
        t, weights, kv_bytes, tokens = _time_decode(cfg, 1, ctx, quantization=quantization,
                                                    kv_cache_dtype=kv_dtype)
        reference = tokens if reference is None else reference
        gbps = (weights + kv_bytes) / t / 1e9
        _report("weights", f"{name}: decode step {t * 1e3:.2f} ms; "
                f"{weights / 1e6:.1f} MB weights + {kv_bytes / 1e6:.1f} MB KV = {gbps:.1f} GB/s "
                f"= {100 * gbps / ctx.peak_gbps:.1f}% of {ctx.peak_gbps:.0f} GB/s; greedy "
                f"tokens equal to bf16's: {int((tokens == reference).sum())}/{len(tokens)} "
                f"(random weights: near ties flip)")
    return []  # it fails by raising: a timing has no threshold


# ---- model families -------------------------------------------------------------------------

GEMMA3_1B = ModelConfig(
    architecture="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
    num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256, rms_norm_eps=1e-6,
    rope_theta=1e6, rope_local_theta=1e4, max_position_embeddings=32768,
    tie_word_embeddings=True, qk_norm=True, sliding_window=512, attn_scale=256**-0.5,
    hidden_act="gelu_pytorch_tanh",
    layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                      for i in range(26)))
MIXTRAL_8_LAYERS = ModelConfig(
    architecture="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
    num_layers=8, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6,
    max_position_embeddings=32768, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=14336)
FAMILY_DECODE = (32, 4096)  # requests, context: 8x Gemma's window
FAMILY_SMOKE_DECODE = (4, 64)


def _family_configs(ctx: Context) -> dict[str, ModelConfig]:
    if not ctx.smoke:
        return {"gemma3-1b": GEMMA3_1B, "mixtral-8-layers": MIXTRAL_8_LAYERS}
    gemma = ModelConfig.tiny("gemma3_text", hidden_size=64, head_dim=64, sliding_window=16,
                             layer_types=("sliding_attention", "full_attention"),
                             rope_local_theta=1e4, hidden_act="gelu_pytorch_tanh", qk_norm=True)
    mixtral = ModelConfig.tiny("mixtral", hidden_size=64, head_dim=64, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=32)
    return {"gemma3-tiny": gemma, "mixtral-tiny": mixtral}


def families(ctx: Context) -> list[str]:
    """Sliding windows and experts on the device: the kernels in the step, its decode time."""
    failures = []
    for name, cfg in _family_configs(ctx).items():
        for impl in ctx.impls:
            if ctx.smoke:
                stage, text = "lowered (abstract device)", _lowered_for_abstract_device(impl, cfg)
            else:
                jitted, args, statics = _engine_step(cfg, impl, jnp.bfloat16)
                stage, text = "compiled", jitted.lower(*args, **statics).compile().as_text()
            kernel = text.count(CUSTOM_CALL[impl]) + text.count(KERNEL_NAME[impl])
            ragged = text.count("ragged_dot") + text.count("ragged-dot")
            ok = kernel > 0 and text.count(FALLBACK) == 0 and (ragged > 0 or not cfg.num_experts)
            _report("families", f"{name} {impl} {stage}: attention kernel x{kernel}"
                    f"{f', ragged_dot x{ragged}' if cfg.num_experts else ''}", ok)
            if not ok:
                failures.append(f"families {name} {impl}")
        decode = FAMILY_SMOKE_DECODE if ctx.smoke else FAMILY_DECODE
        t, weights, kv_bytes, _ = _time_decode(cfg, 1, ctx, decode)
        gbps = (weights + kv_bytes) / t / 1e9
        # KV counted whole: a windowed layer reads only its window, so the true fraction of a
        # Gemma step is lower; experts counted whole too (32 rows x top-2 reach nearly all 8).
        _report("families", f"{name}: decode step ({decode[0]} requests x {decode[1]} tokens) "
                f"{t * 1e3:.2f} ms; {weights / 1e6:.1f} MB weights + {kv_bytes / 1e6:.1f} MB "
                f"KV = {gbps:.1f} GB/s = {100 * gbps / ctx.peak_gbps:.1f}% of "
                f"{ctx.peak_gbps:.0f} GB/s")
    return failures


# ---- first token after start ----------------------------------------------------------------

# A fresh interpreter: import, `LLM(model)` (load and precompile), one greedy one-token generate.
FIRST_TOKEN_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from jaxengine import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(sys.argv[1] or None, compilation_cache_dir=sys.argv[2])
t2 = time.perf_counter()
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=1, temperature=0),
                   use_tqdm=False)
t3 = time.perf_counter()
print(json.dumps(dict(imports=t1 - t0, llm=t2 - t1, generate=t3 - t2,
                      tokens=len(out[0].outputs[0].token_ids))))
"""
FIRST_TOKEN_TARGET_S = 5.0  # issue 37: warm cache, process start to the first token


def first_token(ctx: Context) -> list[str]:
    """Seconds from process start to the first generated token, `LLM()` + one short prompt in
    a fresh subprocess: cold (an empty compilation cache) then warm (the cache it filled).
    The default model (the tiny fixture in the CPU smoke); a figure, no threshold."""
    model = (tiny_model_path() or "") if ctx.smoke else ""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory() as cache:
        for start in ("cold", "warm"):
            t0 = time.perf_counter()
            run = subprocess.run([sys.executable, "-c", FIRST_TOKEN_CHILD, model, cache],
                                 capture_output=True, text=True, env=env, timeout=600)
            wall = time.perf_counter() - t0
            if run.returncode != 0:
                raise RuntimeError(f"{start} start failed: {run.stderr[-2000:]}")
            t = json.loads(run.stdout.strip().splitlines()[-1])
            _report("first-token", f"{start}: {wall:.1f} s from process start to "
                    f"{t['tokens']} token (imports {t['imports']:.1f} s, LLM() "
                    f"{t['llm']:.1f} s, generate {t['generate']:.2f} s; target warm <= "
                    f"{FIRST_TOKEN_TARGET_S:.0f} s) {'tiny model' if model else 'default model'}")
    return []  # a figure: it fails by raising


# Sections in report order: each takes the Context, prints its lines, returns its failures.
SECTIONS: list[Callable[[Context], list[str]]] = [correctness, engine_hlo, timing,
                                                  tensor_parallel, quantized_weights, families,
                                                  first_token]


def _context(args: argparse.Namespace) -> Context:
    backend = jax.default_backend()
    if args.cpu_smoke:
        return Context(impls=("tpu", "gpu"), interpret=True, smoke=True, quick=True,
                       peak_gbps=args.peak_gbps, iters=1)  # fmt: skip
    if backend == "cpu":
        raise SystemExit("device_check: no accelerator here; run with --cpu-smoke")
    iters = args.iters or (5 if args.quick else 20)
    return Context(impls=(default_impl(),), interpret=False, smoke=False, quick=args.quick,
                   peak_gbps=args.peak_gbps, iters=iters)  # fmt: skip


def main() -> int:
    """Run every section; print the summary line; 0 if all passed, else 1."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller grid, fewer iterations")
    p.add_argument("--cpu-smoke", action="store_true", help="CPU, interpret mode, tiny sizes")
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="HBM peak (H200: 4800)")
    p.add_argument("--iters", type=int, default=None, help="timed calls (default 20, quick 5)")
    ctx = _context(p.parse_args())
    print(f"device_check: backend={jax.default_backend()} ({jax.devices()[0].device_kind}) "
          f"jax={jax.__version__} impls={','.join(ctx.impls)} interpret={ctx.interpret} "
          f"{'smoke' if ctx.smoke else 'quick' if ctx.quick else 'full'}", flush=True)
    failures, t0 = [], time.perf_counter()
    for section in SECTIONS:
        try:
            failures += section(ctx)
        except Exception as e:  # report and go on: one device run should show every section
            traceback.print_exc()
            _report(section.__name__, f"raised {type(e).__name__}: {e}", False)
            failures.append(f"{section.__name__} raised")
    verdict = "PASS" if not failures else f"FAIL ({'; '.join(failures)})"
    print(f"summary: {verdict} in {time.perf_counter() - t0:.0f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
