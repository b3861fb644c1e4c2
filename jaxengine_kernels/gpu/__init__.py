"""The Pallas GPU (Triton) ragged paged attention kernel: `kernel.py` the wrapper and shape
rules, `items.py` the work items, `body.py` the kernel bodies."""

from jaxengine_kernels.gpu.kernel import (
    check_cache_dtype,
    check_supported,
    ragged_paged_attention_gpu,
)

__all__ = ["check_cache_dtype", "check_supported", "ragged_paged_attention_gpu"]
