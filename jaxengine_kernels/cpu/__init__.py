"""Native CPU kernels behind XLA FFI custom calls: ragged paged attention (`kernel.py`, the
source `ragged_paged_attention.cc`) and the packed float32 matmul of the model's projections
(`matmul.py`, `packed_matmul.cc`), and the grouped matmul of the MoE experts
(`grouped_matmul.cc`, called by `jaxengine_kernels/grouped_matmul.py`); `native.py` builds them
into one library and registers them."""

from jaxengine_kernels.cpu.kernel import check_supported, ragged_paged_attention_cpu
from jaxengine_kernels.cpu.matmul import pack, packed_matmul
from jaxengine_kernels.cpu.native import NativeBuildError, available

__all__ = ["NativeBuildError", "available", "check_supported", "pack", "packed_matmul",
           "ragged_paged_attention_cpu"]
