"""The engine's kernels: ragged paged attention (a jnp reference, the native CPU kernel, Pallas
kernels for TPU and GPU) and the native CPU packed matmul.

``ragged_paged_attention(..., sliding_window=0, soft_cap=None, impl=default_impl())`` is the one
entry point (a window per layer as a traced operand, Gemma 2's soft-capping as a constant); the
layout and the semantics are documented in ``jaxengine_kernels.reference``.
``check_supported(impl, ...)`` says up front whether a kernel runs a model's shapes.
``jaxengine_kernels.cpu`` also holds the native packed matmul the model's projections use on
CPU (``jaxengine_kernels.cpu.matmul``).
The cache may hold float32, bfloat16 or fp8 (``CACHE_DTYPES``) with per-tensor ``k_scale`` /
``v_scale`` operands (``jaxengine_kernels.cache_dtype``: writes quantize, reads dequantize).
``grouped_matmul(x, w, group_sizes, impl=default_grouped_impl())`` multiplies rows sorted by
group by their group's matrix (the mixture-of-experts layer's experts).
Every kernel is reverse-mode differentiable, its backward run by XLA
(``jaxengine_kernels.gradients`` for attention).
"""

from jaxengine_kernels.attention import (
    IMPLS,
    check_supported,
    default_impl,
    ragged_paged_attention,
)
from jaxengine_kernels.cache_dtype import CACHE_DTYPES
from jaxengine_kernels.errors import UnsupportedShapeError
from jaxengine_kernels.grouped_matmul import (
    GROUPED_IMPLS,
    default_grouped_impl,
    grouped_matmul,
)
from jaxengine_kernels.reference import ragged_paged_attention_reference, write_kv

__all__ = [
    "CACHE_DTYPES",
    "GROUPED_IMPLS",
    "IMPLS",
    "UnsupportedShapeError",
    "check_supported",
    "default_grouped_impl",
    "default_impl",
    "grouped_matmul",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "write_kv",
]
