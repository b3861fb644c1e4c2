"""Fixtures of the CPU kernel tests: the native library built for each ISA level the CPU can
execute, and its attention kernel as a function."""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine_kernels.cpu import native


@pytest.fixture(scope="session")
def isa_library() -> Callable[[str], ctypes.CDLL]:
    """`load(name)`: the native library built for ISA level `name` (`"avx2"`), which reports
    that path itself; the test is skipped, naming the missing CPU flags, where this CPU cannot
    execute the build (the one legitimate skip: its code would die of an illegal instruction).

    The builds go to native's own cache (keyed by everything they depend on, so later sessions
    and `JAXENGINE_CPU_ISA` subprocesses load them: about 10 s of g++ per level on 2 cores)."""

    def load(name: str) -> ctypes.CDLL:
        if not native._is_x86():
            pytest.skip(f"x86 ISA levels; this machine is {platform.machine()}")
        if missing := native.missing_cpu_flags(name):
            pytest.skip(f"this CPU cannot run the {name} build: it lacks {', '.join(missing)}")
        path = native._build(native._compiler(), native.isa_flags(name))
        library = ctypes.cdll.LoadLibrary(str(path))
        library.JaxengineCpuIsa.restype = ctypes.c_char_p
        assert library.JaxengineCpuIsa().decode() == name
        return library

    return load


@pytest.fixture(scope="session")
def isa_attention(isa_library: Callable[[str], ctypes.CDLL]) -> Callable[[str], Callable]:
    """`attention(name)`: the attention kernel (float32 queries, a cache of any dtype it
    reads) of `name`'s build ("native": the library the process loaded) as `f(q, cache,
    tables, seq_lens, query_start_loc, num_seqs, *, sm_scale, block_q, pages_per_split,
    batch_invariant=False, sliding_window=0, soft_cap=0.0, fp8_bits="") -> out [T, N, H]`
    (`fp8_bits`: the fp8 format of a uint8 cache's bytes), the new K/V
    already in the cache. Each build's custom-call target is registered once, under a name
    of its own."""
    targets: dict[str, str] = {}

    def attention(name: str) -> Callable:
        if name not in targets:
            if name == "native":
                targets[name] = native.target(jnp.float32)
            else:
                library = isa_library(name)
                targets[name] = f"jaxengine_test_ragged_paged_attention_{name}"
                jax.ffi.register_ffi_target(
                    targets[name], jax.ffi.pycapsule(library.RaggedPagedAttention),
                    platform="cpu")

        def call(q, cache, *metadata, sm_scale: float, block_q: int, pages_per_split: int,
                 batch_invariant: bool = False, sliding_window: int = 0, soft_cap: float = 0.0,
                 fp8_bits: str = ""):
            return jax.ffi.ffi_call(targets[name], jax.ShapeDtypeStruct(q.shape, jnp.float32))(
                q, cache, *metadata, jnp.asarray(sliding_window, jnp.int32),
                jnp.float32(1.0), jnp.float32(1.0),  # k_scale, v_scale
                sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap),
                block_q=np.int64(block_q), pages_per_split=np.int64(pages_per_split),
                batch_invariant=batch_invariant, fp8_bits=fp8_bits)

        return call

    return attention
