"""The Pallas TPU (Mosaic) ragged paged attention kernel: `kernel.py` the wrapper and shape
rules, `body.py` the kernel body."""

from jaxengine_kernels.tpu.kernel import (
    check_cache_dtype,
    check_supported,
    ragged_paged_attention_tpu,
)

__all__ = ["check_cache_dtype", "check_supported", "ragged_paged_attention_tpu"]
