"""The public entry point: ragged paged attention with a choice of implementation.

``impl`` picks the jnp reference, the native CPU kernel (an XLA FFI custom call), the Pallas
Mosaic TPU kernel or the Pallas (Triton) GPU kernel; all share one signature and layout (see
``jaxengine_kernels.reference``). A kernel that
cannot handle a shape raises ``UnsupportedShapeError`` (a ``ValueError``) while tracing, and
the error propagates: a kernel chosen explicitly never turns into the reference silently. A
caller checks its shapes up front with ``check_supported`` (the engine does at build).

The cache may be quantized (``jaxengine_kernels.cache_dtype``: float32, bfloat16, fp8 e4m3fn or
e5m2 with per-tensor ``k_scale`` / ``v_scale``, vLLM's semantics); every implementation writes
the new K/V quantized and dequantizes what it reads, with float32 arithmetic. The reference
and the CPU kernel also take an fp8 cache stored as its bits in uint8 (``kv_cache_dtype``
names the format), which XLA on CPU updates in place.

Every implementation is reverse-mode differentiable (``jaxengine_kernels.gradients``): the
forward is the chosen kernel, unchanged; the backward is XLA's, the VJP of the reference's
maths with static trip counts, for the Pallas kernels too (they have no backward kernel).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

# The kernels are imported eagerly although only one is used: importing Pallas defines config
# options, which changes jax's tracing context; importing it lazily inside the first trace makes
# the caller's jit compile twice.
from jaxengine_kernels import cpu, gpu, tpu
from jaxengine_kernels.cache_dtype import check_dtypes, check_scale, values_dtype
from jaxengine_kernels.gradients import Backward, with_backward
from jaxengine_kernels.reference import ragged_paged_attention_reference

logger = logging.getLogger("jaxengine.kernels")

Impl = Literal["reference", "cpu", "tpu", "gpu"]
IMPLS: tuple[str, ...] = ("reference", "cpu", "tpu", "gpu")
_KERNELS: dict[str, Callable[..., tuple[jax.Array, jax.Array]]] = {
    "cpu": cpu.ragged_paged_attention_cpu,
    "tpu": tpu.ragged_paged_attention_tpu,
    "gpu": gpu.ragged_paged_attention_gpu,
}
_CHECKS: dict[str, Callable[..., None]] = {
    "cpu": cpu.check_supported,
    "tpu": tpu.check_supported,
    "gpu": gpu.check_supported,
}
_warned_unavailable = False


def default_impl(platform: str | None = None) -> Impl:
    """The implementation for a jax platform: the Pallas kernel on tpu and gpu, the native
    kernel on cpu (the jnp reference where it cannot be built, with a warning saying why).

    The one place that maps platforms to implementations (the engine asks it too). On cpu the
    first call builds the native kernel if no earlier process did (a few seconds, cached).

    Args:
      platform: a ``jax.default_backend()`` name (``"cpu"``, ``"gpu"``, ``"tpu"``; jax names
        CUDA and ROCm devices ``"gpu"``); default: ``jax.default_backend()``.
    """
    global _warned_unavailable
    platform = jax.default_backend() if platform is None else platform
    if platform == "tpu":
        return "tpu"
    if platform == "gpu":
        return "gpu"
    if platform == "cpu":
        why = cpu.available()
        if why is None:
            return "cpu"
        if not _warned_unavailable:
            _warned_unavailable = True
            logger.warning("the native CPU attention kernel is unavailable (%s); using the "
                           "jnp reference, which is several times slower", why)
    return "reference"


def check_supported(
    impl: Impl, *, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
    kv_cache_dtype: jnp.dtype = jnp.float32,
) -> None:
    """Raise ``UnsupportedShapeError`` if ``impl`` cannot run these shapes (default blocks) or
    hold a cache of ``kv_cache_dtype`` on this machine's devices.

    The reference and the CPU kernel run every shape and cache dtype; ``num_heads`` is a
    multiple of ``num_kv_heads``. Where jax runs on the kernel's platform, its first device
    says which cache dtypes it holds: fp8 on TPU needs v5p, v6e or later; float8_e4m3fn on a
    GPU compute capability 8.9 or later (Ada, Hopper; float8_e5m2 runs on any). On another
    platform (the Pallas kernels in interpret mode) every cache dtype runs.

    Raises:
      UnsupportedShapeError: naming the parameter (``.field``) and its value (``.value``).
      ValueError: for an unknown ``impl`` or a cache dtype none of them reads.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    check_dtypes(jnp.float32, kv_cache_dtype)
    if impl == "reference":
        return
    _CHECKS[impl](num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                  page_size=page_size)
    if impl != jax.default_backend():
        return
    device = jax.devices()[0]
    if impl == "tpu":
        tpu.check_cache_dtype(kv_cache_dtype, device.device_kind)
    elif impl == "gpu":
        gpu.check_cache_dtype(kv_cache_dtype, device.compute_capability)


def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    kv_cache: jax.Array,  # [P, L, 2*K, H]
    slot_mapping: jax.Array,  # i32[T]
    block_tables: jax.Array,  # i32[R, max_blocks]
    seq_lens: jax.Array,  # i32[R]
    query_start_loc: jax.Array,  # i32[R+1]
    num_seqs: jax.Array,  # i32[]
    *,
    sm_scale: float,
    sliding_window: int | jax.Array = 0,
    soft_cap: float | None = None,
    k_scale: float | jax.Array = 1.0,
    v_scale: float | jax.Array = 1.0,
    impl: Impl = "reference",
    interpret: bool = False,
    batch_invariant: bool = False,
    kv_cache_dtype: jnp.dtype | None = None,
    **block_sizes: int,
) -> tuple[jax.Array, jax.Array]:
    """Write the new K/V into the paged cache, then attend causally over each request's pages.

    Args:
      q: f32/bf16 queries of all scheduled tokens ``[T, N, H]`` (padding rows after).
      k, v: their new keys/values ``[T, K, H]``, in q's dtype.
      kv_cache: one layer's pages ``[P, L, 2*K, H]``; K at even, V at odd head slots. Its
        dtype may differ from q's: float32, bfloat16, float8_e4m3fn (vLLM's "fp8") or
        float8_e5m2 ("fp8_e5m2").
      slot_mapping: i32[T] flat slot (page * L + offset) per token; padding -> block 0.
      block_tables: i32[R, max_blocks] pages of each request.
      seq_lens: i32[R] context length after this step.
      query_start_loc: i32[R+1] prefix sums of scheduled tokens.
      num_seqs: i32[] number of live requests; rows past it are ignored.
      sm_scale: softmax scale.
      sliding_window: i32[] (a traced scalar or a Python int): the window W of this layer, 0
        for full attention. A query at position p sees the keys at k with ``p - W < k <= p``
        (W keys, itself included: transformers' rule). An operand, not a static argument, so
        that one compiled scan over layers can give each layer its own window. Every
        implementation skips the pages wholly outside a query's window: they are not read.
      soft_cap: Gemma 2's attention-logit soft-capping: the scores ``s = q.k * sm_scale``
        become ``soft_cap * tanh(s / soft_cap)`` before the mask and the softmax; None for
        none. Static (a per-model constant).
      k_scale, v_scale: f32[] per-tensor scales of the cached keys and values (traced scalars
        or Python floats; operands, so one compiled scan over layers can give each layer its
        own). The cache holds ``k / k_scale`` in its dtype, for fp8 clipped to the format's
        finite range first so that values beyond it saturate to the largest finite value
        instead of becoming inf or NaN; a read stands for ``cache.astype(float32) *
        k_scale`` (likewise V). Applied in every dtype; 1.0 for an unscaled cache.
      impl: "reference" (jnp), "cpu" (native, XLA FFI), "tpu" (Pallas Mosaic) or "gpu"
        (Pallas Triton).
      interpret: run a Pallas kernel in interpret mode (CPU testing); ignored by the
        reference and the CPU kernel.
      batch_invariant: a token's output the same bits whatever else the batch holds and
        however its request's tokens were cut into chunks (a decode, a whole prompt, the tail
        after a cached prefix); the "cpu" kernel's mode, a ``ValueError`` for the others.
      kv_cache_dtype: the dtype of the cache's values: required for a uint8 ``kv_cache``,
        which holds the bits of fp8 values (float8_e4m3fn or float8_e5m2; "reference" and
        "cpu" only: on CPU, XLA scatters into a donated uint8 array in place, not into an fp8
        one, ``cache_dtype.storage_dtype``); else None or the cache's dtype. Static.
      **block_sizes: implementation-specific static block sizes (e.g. ``block_q``).

    Returns:
      ``(out [T, N, H] in q.dtype, updated kv_cache)``. Output rows of padding tokens are
      unspecified. Differentiable in q, k, v and kv_cache (``jaxengine_kernels.gradients``;
      the backward runs in XLA whatever ``impl``); the scales, the window and the integer
      operands are constants.

    Raises:
      UnsupportedShapeError: the chosen kernel cannot run these shapes or block sizes.
      ValueError: for an unknown ``impl``, ``batch_invariant`` with another than "cpu", a
        negative Python ``sliding_window``, a ``soft_cap`` or Python scale that is not
        positive, a q or cache dtype not supported, or a uint8 cache without an fp8
        ``kv_cache_dtype`` or for an impl that does not read bits; under differentiation, a
        uint8 cache of fp8 bits (it cannot carry a gradient).
    """
    _check_window_and_cap(sliding_window, soft_cap)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    values = values_dtype(kv_cache.dtype, kv_cache_dtype, impl)
    check_dtypes(q.dtype, values)
    scales = {"k_scale": check_scale("k_scale", k_scale),
              "v_scale": check_scale("v_scale", v_scale)}  # fmt: skip
    args = (q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, num_seqs)
    if batch_invariant:
        if impl != "cpu":
            raise ValueError(f"batch_invariant=True is a mode of the 'cpu' kernel only, not of "
                             f"impl={impl!r}")
        block_sizes = {**block_sizes, "batch_invariant": True}
    window = jnp.asarray(sliding_window, jnp.int32)
    if values != kv_cache.dtype:  # fp8 bits: the implementation is told the format
        block_sizes = {**block_sizes, "kv_cache_dtype": values}
    if impl == "reference":
        kernel = ragged_paged_attention_reference
    else:
        kernel = functools.partial(_KERNELS[impl], interpret=interpret)

    def forward(*args: jax.Array) -> tuple[jax.Array, jax.Array]:
        *args, window, k_scale, v_scale = args
        return kernel(*args, sm_scale=sm_scale, sliding_window=window, soft_cap=soft_cap,
                      k_scale=k_scale, v_scale=v_scale, **block_sizes)

    backward = Backward(sm_scale=sm_scale, soft_cap=soft_cap, kv_cache_dtype=values)
    return with_backward(forward, backward, *args, window, scales["k_scale"], scales["v_scale"])


def _check_window_and_cap(sliding_window: int | jax.Array, soft_cap: float | None) -> None:
    """``ValueError`` naming the argument for a negative Python window or a cap <= 0 (a traced
    window is the model's, checked where its config is)."""
    if isinstance(sliding_window, int) and sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 (0: full attention), got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be a positive float or None, got {soft_cap!r}")
