"""The native CPU ragged paged attention kernel: `kernel.py` the wrapper, `native.py` the build
and registration of `ragged_paged_attention.cc` (an XLA FFI custom call)."""

from pallas_kernels.cpu.kernel import check_supported, ragged_paged_attention_cpu
from pallas_kernels.cpu.native import NativeBuildError, available

__all__ = ["NativeBuildError", "available", "check_supported", "ragged_paged_attention_cpu"]
