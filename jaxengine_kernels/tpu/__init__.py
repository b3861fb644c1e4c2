"""The Pallas TPU (Mosaic) ragged paged attention kernel: `kernel.py` the wrapper and shape
rules, `body.py` the kernel body."""

from jaxengine_kernels.tpu.kernel import check_supported, ragged_paged_attention_tpu

__all__ = ["check_supported", "ragged_paged_attention_tpu"]
