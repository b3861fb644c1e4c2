"""Native CPU kernels behind XLA FFI custom calls: ragged paged attention (`kernel.py`, the
source `ragged_paged_attention.cc`), the packed matmul of the model's projections over float32
or int8 panels (`matmul.py`, `packed_matmul.cc`), the matmul over GGUF Q4_1 / Q8_0 blocks
(`block_matmul.py`, `block_matmul.cc`), and the grouped matmul of the MoE experts
(`grouped_matmul.cc`, called by `jaxengine_kernels/grouped_matmul.py`); `native.py` builds them
into one library and registers them."""

from jaxengine_kernels.cpu.kernel import check_supported, ragged_paged_attention_cpu
from jaxengine_kernels.cpu.matmul import pack, packed_matmul
from jaxengine_kernels.cpu.native import NativeBuildError, available

__all__ = ["NativeBuildError", "available", "check_supported", "pack", "packed_matmul",
           "ragged_paged_attention_cpu"]
