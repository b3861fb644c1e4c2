"""Ragged paged attention: a jnp reference and Pallas kernels for TPU and GPU.

``ragged_paged_attention(..., impl=default_impl())`` is the one entry point; the layout and the
semantics are documented in ``pallas_kernels.reference``. ``check_supported(impl, ...)`` says
up front whether a kernel runs a model's shapes. ``pallas_kernels.cpu`` also holds the native
packed matmul the model's projections use on CPU (``pallas_kernels.cpu.matmul``).
"""

from pallas_kernels.attention import (
    IMPLS,
    check_supported,
    default_impl,
    ragged_paged_attention,
)
from pallas_kernels.errors import UnsupportedShapeError
from pallas_kernels.reference import ragged_paged_attention_reference, write_kv

__all__ = [
    "IMPLS",
    "UnsupportedShapeError",
    "check_supported",
    "default_impl",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "write_kv",
]
