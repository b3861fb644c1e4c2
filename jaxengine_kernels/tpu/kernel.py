"""Ragged paged attention as a Pallas Mosaic TPU kernel.

Layout assumptions (see ``jaxengine_kernels.reference`` for the semantics):

- The token axis is cut into q-blocks of ``block_q`` tokens; the grid has one step per q-block.
  A q-block may hold many requests (a whole batch of decodes fits in one), so decodes do not
  waste q-blocks: the kernel walks, inside the step, every request that has tokens in the block.
- Queries are regrouped by the wrapper into ``[K, T*G, H]`` (row ``t*G + g`` is token t, query
  head ``k*G + g``), so a kv head's queries are one 2-D tile and no ref is reshaped in the kernel.
- ``block_tables``, ``seq_lens``, ``query_start_loc``, ``num_seqs``, the sliding window,
  ``slot_mapping`` and the first request of each q-block are scalar-prefetched into SMEM
  (``PrefetchScalarGridSpec``).
- The cache stays in HBM (``memory_space=pl.ANY``); each request's pages are copied to VMEM
  ``pages_per_block`` at a time with ``make_async_copy`` into a double buffer: the copy of the
  next (request, kv block) pair starts before the current one is used, across request
  boundaries inside a step (not across grid steps). Pages are addressed with two-level
  ``.at[page]`` indexing, never through a reshaped ref (the TPU interpreter cannot DMA through
  one).
- The new K/V are written in place: the cache is aliased input→output (``input_output_aliases``)
  and each q-block first DMAs its own tokens' K/V rows (interleaved by the wrapper to
  ``[T, 2*K, H]``) to their slots, waits, then attends. The grid runs sequentially
  (``"arbitrary"``), so every earlier q-block's writes are visible; later tokens of the same
  request are causally masked anyway. Padding tokens (past ``query_start_loc[num_seqs]``)
  write nothing.
- Online softmax in float32. Masks are selects (``jnp.where``) on the logits and on V, so
  garbage (NaN, Inf) in unused pages, past a context or in the slots of the request's tokens
  in later q-blocks (not written yet) never reaches the output; a multiply by zero would.

Checked on CPU in the TPU interpreter (``interpret=True`` → ``pltpu.InterpretParams()``), and
its lowering to Mosaic MLIR for an abstract TPU v6e is checked on CPU too; it has not been
compiled by the Mosaic compiler nor run on a real TPU yet. ``block_tables`` lives in SMEM
(flattened to 1-D), which bounds ``max_num_seqs * max_blocks`` to roughly 200k entries.
Megacore (two TensorCores) is not used: the grid is sequential.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxengine_kernels.cache_dtype import FP8_DTYPES
from jaxengine_kernels.errors import UnsupportedShapeError
from jaxengine_kernels.reference import new_rows
from jaxengine_kernels.tpu import body

NUM_LANES = 128  # m / l scratch is lane-replicated, as Mosaic wants full (8, 128) tiles.


def default_block_sizes(head_dim: int, page_size: int) -> dict[str, int]:
    """Default ``block_q`` / ``pages_per_block`` for a head dim and page size."""
    kv_tokens = 256 if head_dim <= 128 else 128  # keeps the double buffer well under 2 MiB
    return {"block_q": 16, "pages_per_block": max(1, kv_tokens // page_size)}


def check_supported(
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    block_q: int | None = None,
    pages_per_block: int | None = None,
) -> None:
    """Raise ``UnsupportedShapeError`` if this kernel cannot run these shapes.

    Block sizes left ``None`` take ``default_block_sizes``; ``num_heads`` is a multiple of
    ``num_kv_heads``.
    """
    defaults = default_block_sizes(head_dim, page_size)
    block_q = block_q or defaults["block_q"]
    pages_per_block = pages_per_block or defaults["pages_per_block"]
    if head_dim % 64:
        raise UnsupportedShapeError("head_dim", head_dim, "a multiple of 64 for the TPU kernel")
    if page_size % 8:
        raise UnsupportedShapeError("page_size", page_size, "a multiple of 8 for the TPU kernel")
    rows = block_q * (num_heads // num_kv_heads)
    if rows % 8:
        raise UnsupportedShapeError(
            "block_q * heads per kv head", rows, "a multiple of 8 for the TPU kernel"
        )
    if pages_per_block < 1:
        raise UnsupportedShapeError("pages_per_block", pages_per_block, ">= 1")


# TPU generations without fp8 in Mosaic (their device_kind): fp8 needs v5p, v6e or later.
NO_FP8_KINDS = ("TPU v2", "TPU v3", "TPU v4", "TPU v4 lite", "TPU v5 lite", "TPU v5e")


def check_cache_dtype(cache_dtype: jnp.dtype, device_kind: str) -> None:
    """Raise ``UnsupportedShapeError`` (field ``kv_cache_dtype``) for an fp8 cache on a TPU
    generation that cannot hold it (``device_kind`` as ``jax.Device.device_kind`` says it)."""
    dtype = jnp.dtype(cache_dtype)
    if dtype in FP8_DTYPES and device_kind in NO_FP8_KINDS:
        raise UnsupportedShapeError("kv_cache_dtype", dtype.name,
                                    f"float32 or bfloat16 on {device_kind} (fp8 needs TPU v5p, "
                                    f"v6e or later)")


def check_shapes(q: jax.Array, kv_cache: jax.Array, block_q: int, pages_per_block: int) -> None:
    """``check_supported`` for these arrays; ``ValueError`` for an inconsistent head layout."""
    _, N, H = q.shape
    _, L, K2, Hk = kv_cache.shape
    if K2 % 2 or N % (K2 // 2) or Hk != H:
        raise ValueError(f"bad head layout: q heads {N}, cache head slots {K2}, dims {H}/{Hk}")
    check_supported(num_heads=N, num_kv_heads=K2 // 2, head_dim=H, page_size=L,
                    block_q=block_q, pages_per_block=pages_per_block)  # fmt: skip


def _first_request_of_blocks(
    query_start_loc: jax.Array,  # i32[R+1]
    num_seqs: jax.Array,  # i32[]
    num_blocks: int,
    block_q: int,
) -> jax.Array:  # i32[num_blocks]
    """The first live request with a token in each q-block (``num_seqs`` when none)."""
    R = query_start_loc.shape[0] - 1
    starts = jnp.arange(num_blocks, dtype=jnp.int32) * block_q
    ends = jnp.where(jnp.arange(R) < num_seqs, query_start_loc[1:], jnp.iinfo(jnp.int32).max)
    first = jnp.searchsorted(ends, starts, side="right").astype(jnp.int32)
    return jnp.minimum(first, num_seqs)


def _pallas_call(
    q_k: jax.Array,  # [K, Tp*G, H]
    kv_cache: jax.Array,  # [P, L, 2*K, H]
    *,
    num_scalars: int,
    block_q: int,
    group: int,
    pages_per_block: int,
    max_blocks: int,
    sm_scale: float,
    soft_cap: float | None,
    interpret: bool,
    vmem_limit_bytes: int | None,
) -> Callable[..., list[jax.Array]]:
    """The pallas_call: one grid step per q-block, the cache in HBM aliased input -> output."""
    K, rows_total, H = q_k.shape
    _, L, K2, _ = kv_cache.shape
    bq, C, rows = block_q, pages_per_block, block_q * group
    q_spec = pl.BlockSpec((K, rows, H), lambda b, *_: (0, b, 0))
    return pl.pallas_call(
        functools.partial(body.kernel, sm_scale=sm_scale, soft_cap=soft_cap, block_q=bq,
                          max_blocks=max_blocks),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=num_scalars,
            grid=(rows_total // rows,),
            in_specs=[
                q_spec,
                pl.BlockSpec((bq, K2, H), lambda b, *_: (b, 0, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[
                pltpu.VMEM((2, C, L, K2, H), kv_cache.dtype),  # double-buffered kv blocks
                pltpu.SemaphoreType.DMA((2,)),  # one per kv buffer
                pltpu.SemaphoreType.DMA(()),  # the K/V writes
                pltpu.VMEM((K, rows, NUM_LANES), jnp.float32),  # m
                pltpu.VMEM((K, rows, NUM_LANES), jnp.float32),  # l
                pltpu.VMEM((K, rows, H), jnp.float32),  # acc
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(q_k.shape, q_k.dtype),
            jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        ],
        # The cache comes after the scalar-prefetch operands, q and kv_new.
        input_output_aliases={num_scalars + 2: 1},
        compiler_params=pltpu.CompilerParams(
            # Sequential: a q-block reads K/V that earlier q-blocks wrote.
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=vmem_limit_bytes,
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ragged_paged_attention_tpu",
    )


@functools.partial(
    jax.jit,
    # Block sizes shape the grid and the scratch buffers; interpret selects the lowering.
    static_argnames=(
        "sm_scale", "soft_cap", "interpret", "block_q", "pages_per_block", "vmem_limit_bytes"
    ),
)
def ragged_paged_attention_tpu(
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
    sliding_window: jax.Array | int = 0,
    soft_cap: float | None = None,
    k_scale: jax.Array | float = 1.0,
    v_scale: jax.Array | float = 1.0,
    interpret: bool = False,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Ragged paged attention on TPU (same contract as ``ragged_paged_attention``).

    Args:
      q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, num_seqs: as in
        ``jaxengine_kernels.ragged_paged_attention``.
      sm_scale: softmax scale.
      sliding_window: i32[] the layer's window (0: full attention), scalar-prefetched: each
        request's walk starts at the kv block of its first visible key.
      soft_cap: the scores' soft cap, or None.
      k_scale, v_scale: f32[] per-tensor scales of the cached keys and values,
        scalar-prefetched: pages are copied in the cache's dtype and widened in the kernel.
      interpret: run in the TPU interpreter (``pltpu.InterpretParams()``), e.g. on CPU.
      block_q: tokens per q-block (grid step).
      pages_per_block: pages per DMA'd kv block.
      vmem_limit_bytes: Mosaic scoped-VMEM limit (default: the compiler's).

    Returns:
      ``(out [T, N, H] in q.dtype, kv_cache)`` with the new K/V written in place.

    Raises:
      UnsupportedShapeError: for shapes the kernel does not handle (see
        ``check_supported``); ValueError for inconsistent head layouts.
    """
    T, N, H = q.shape
    P, L, K2, _ = kv_cache.shape
    K = K2 // 2
    defaults = default_block_sizes(H, L)
    bq = block_q or defaults["block_q"]
    C = pages_per_block or defaults["pages_per_block"]
    check_shapes(q, kv_cache, bq, C)
    G = N // K
    nb = pl.cdiv(T, bq)
    Tp = nb * bq
    # [T, N, H] -> [K, T*G, H]: one kv head's queries form one 2-D tile per q-block.
    q_k = jnp.pad(q, ((0, Tp - T), (0, 0), (0, 0))).reshape(Tp, K, G, H)
    q_k = q_k.transpose(1, 0, 2, 3).reshape(K, Tp * G, H)
    kv_new = new_rows(k, v, kv_cache.dtype, k_scale, v_scale)
    kv_new = jnp.pad(kv_new, ((0, Tp - T), (0, 0), (0, 0)))
    num_seqs_1 = jnp.reshape(num_seqs, (1,)).astype(jnp.int32)
    scalars = (
        seq_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32).reshape(-1),  # 1-D: 2-D SMEM arrays pad each row
        query_start_loc.astype(jnp.int32),
        num_seqs_1,
        jnp.reshape(sliding_window, (1,)).astype(jnp.int32),
        jnp.stack([jnp.asarray(k_scale), jnp.asarray(v_scale)]).astype(jnp.float32),
        jnp.pad(slot_mapping.astype(jnp.int32), (0, Tp - T)),
        _first_request_of_blocks(query_start_loc, num_seqs, nb, bq),
    )
    kernel = _pallas_call(
        q_k, kv_cache, num_scalars=len(scalars), block_q=bq, group=G, pages_per_block=C,
        max_blocks=block_tables.shape[1], sm_scale=sm_scale, soft_cap=soft_cap,
        interpret=interpret,
        vmem_limit_bytes=vmem_limit_bytes,
    )  # fmt: skip
    out_k, kv_cache = kernel(*scalars, q_k, kv_new, kv_cache)
    out = out_k.reshape(K, Tp, G, H).transpose(1, 0, 2, 3).reshape(Tp, N, H)
    return out[:T], kv_cache
