"""Decode steps of whole models on the device: tensor parallel, quantized weights and KV, and
the families with sliding windows and experts, each against the HBM roofline."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.device_sections.context import PAGE_SIZE, Context, report
from benchmarks.device_sections.kernel import (
    CUSTOM_CALL,
    FALLBACK,
    KERNEL_NAME,
    engine_step,
    lowered_for_abstract_device,
)
from jaxengine.engine.build import model_fns
from jaxengine.model.batch import ModelBatch, RequestChunk
from jaxengine.model.config import ModelConfig
from jaxengine.model.decoder import Model
from jaxengine.model.mesh import make_mesh
from jaxengine.model.quant.formats import multiplies_fp8
from jaxengine.model.step import pack_batch
from jaxengine.runner.programs import programs_for
from jaxengine.sampling.logits_processors import build_adjustments
from jaxengine.sampling.request_tables import init_tables
from jaxengine.sampling.rows import build_sampling_metadata
from jaxengine_kernels import default_impl

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


def time_decode(cfg: ModelConfig, tp: int, ctx: Context,
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
            report("tensor-parallel", f"tp={tp}: skipped ({count} device(s))")
            continue
        t, weights, kv_bytes, tokens = time_decode(cfg, tp, ctx)  # the model is freed after
        reference = tokens if reference is None else reference
        gbps = (weights + kv_bytes) / t / 1e9
        same = int((tokens == reference).sum())
        report("tensor-parallel", f"tp={tp}: decode step {t * 1e3:.2f} ms; per device "
                f"{weights / 1e6:.1f} MB weights + {kv_bytes / 1e6:.1f} MB KV = {gbps:.1f} "
                f"GB/s = {100 * gbps / ctx.peak_gbps:.1f}% of {ctx.peak_gbps:.0f} GB/s; "
                f"greedy tokens equal to tp=1's: {same}/{len(tokens)} (bf16, random weights: "
                f"near ties may flip)")
    return []  # it fails by raising: a timing has no threshold


# ---- quantized weights ----------------------------------------------------------------------


def quantized_weights(ctx: Context) -> list[str]:
    """The tensor-parallel section's decode step at tp=1 with bf16, int8 and fp8 weights (bf16
    activations; fp8 x fp8 dots where the device multiplies fp8), and bf16 weights over an
    fp8 KV cache: time, weight and KV bytes, fraction of the HBM roofline, greedy tokens vs
    bf16's."""
    cfg = ModelConfig.tiny(num_heads=8, num_kv_heads=2, hidden_size=64, vocab_size=100) \
        if ctx.smoke else LLAMA3_8B
    fp8 = "fp8 x fp8 dots" if multiplies_fp8(make_mesh(jax.devices()[:1])) else "weight-only"
    reference = None
    for name, quantization, kv_dtype in (("bf16", None, None), ("int8", "int8", None),
                                         (f"fp8 ({fp8})", "fp8", None),
                                         ("bf16 + fp8 KV", None, jnp.float8_e4m3fn)):
        t, weights, kv_bytes, tokens = time_decode(cfg, 1, ctx, quantization=quantization,
                                                    kv_cache_dtype=kv_dtype)
        reference = tokens if reference is None else reference
        gbps = (weights + kv_bytes) / t / 1e9
        report("weights", f"{name}: decode step {t * 1e3:.2f} ms; "
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
                stage, text = "lowered (abstract device)", lowered_for_abstract_device(impl, cfg)
            else:
                jitted, args, statics = engine_step(cfg, impl, jnp.bfloat16)
                stage, text = "compiled", jitted.lower(*args, **statics).compile().as_text()
            kernel = text.count(CUSTOM_CALL[impl]) + text.count(KERNEL_NAME[impl])
            ragged = text.count("ragged_dot") + text.count("ragged-dot")
            ok = kernel > 0 and text.count(FALLBACK) == 0 and (ragged > 0 or not cfg.num_experts)
            report("families", f"{name} {impl} {stage}: attention kernel x{kernel}"
                    f"{f', ragged_dot x{ragged}' if cfg.num_experts else ''}", ok)
            if not ok:
                failures.append(f"families {name} {impl}")
        decode = FAMILY_SMOKE_DECODE if ctx.smoke else FAMILY_DECODE
        t, weights, kv_bytes, _ = time_decode(cfg, 1, ctx, decode)
        gbps = (weights + kv_bytes) / t / 1e9
        # KV counted whole: a windowed layer reads only its window, so the true fraction of a
        # Gemma step is lower; experts counted whole too (32 rows x top-2 reach nearly all 8).
        report("families", f"{name}: decode step ({decode[0]} requests x {decode[1]} tokens) "
                f"{t * 1e3:.2f} ms; {weights / 1e6:.1f} MB weights + {kv_bytes / 1e6:.1f} MB "
                f"KV = {gbps:.1f} GB/s = {100 * gbps / ctx.peak_gbps:.1f}% of "
                f"{ctx.peak_gbps:.0f} GB/s")
    return failures

