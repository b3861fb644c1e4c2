"""Building and registering the CPU kernels' shared library.

`ragged_paged_attention.cc`, `packed_matmul.cc`, `block_matmul.cc` and `grouped_matmul.cc` are
compiled into one library with the machine's C++ compiler the first time a process needs it (a
few seconds), into `$XDG_CACHE_HOME/jaxengine/native/<key>/` (by default
`~/.cache/jaxengine/native/`; `$JAXENGINE_NATIVE_CACHE_DIR` overrides), and later processes
load that file. The key hashes
everything the binary depends on: the sources and their headers, the compiler and its flags,
jaxlib's version (the FFI headers come from it) and the CPU (`-march=native`), so a changed
source, toolchain, jax or machine builds anew instead of loading a wrong binary. The compiler
writes to a temporary file that is renamed into place, so processes that build at once do not
see each other's half-written files.

`$JAXENGINE_CPU_ISA` picks the instruction set: `native` (the default: all this CPU has) or, on
x86, a named level this CPU can execute: `avx512` (x86-64-v4, 16-float vectors), `avx2`
(x86-64-v3, 8) or `sse2` (x86-64, 4), e.g. to run the paths other machines take. `isa()` and
`vector_lanes()` say which path the loaded library runs, as the binary itself reports it.

Nothing here is needed on TPU or GPU. Without a C++ compiler (`$CXX`, else c++, g++ or
clang++) the kernels are unavailable: `jaxengine_kernels.default_impl` then picks the jnp reference
and says why in a warning, an explicit ``impl="cpu"`` raises `NativeBuildError`, and the model
keeps XLA's dots (`jaxengine_kernels.cpu.matmul`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

from jaxengine_kernels.cache_dtype import CACHE_DTYPES

logger = logging.getLogger("jaxengine.kernels")

SOURCES = tuple(Path(__file__).with_name(name) for name in ("ragged_paged_attention.cc",
                                                             "packed_matmul.cc",
                                                             "block_matmul.cc",
                                                             "grouped_matmul.cc"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("parallel_for.h", "simd.h"))
LIBRARY = "libjaxengine_cpu_kernels.so"
# XLA custom-call targets and the library symbols behind them. The attention target takes
# float32 queries and a cache of any of CACHE_DTYPES (it dispatches on the cache's dtype).
ATTENTION_TARGET = ("jaxengine_ragged_paged_attention", "RaggedPagedAttention")
MATMUL_TARGET = ("jaxengine_packed_matmul_f32", "PackedMatmulF32")
SWIGLU_TARGET = ("jaxengine_packed_swiglu_f32", "PackedSwiGLUF32")
INT8_TARGETS = (("jaxengine_packed_matmul_int8", "PackedMatmulInt8"),
                ("jaxengine_packed_swiglu_int8", "PackedSwiGLUInt8"))
# The GGUF block kernels per quantization type: (plain product, SwiGLU product), each a
# (target, symbol) pair.
BLOCK_TARGETS = {
    "Q4_1": (("jaxengine_block_matmul_q4_1", "BlockMatmulQ4_1"),
             ("jaxengine_block_swiglu_q4_1", "BlockSwiGLUQ4_1")),
    "Q8_0": (("jaxengine_block_matmul_q8_0", "BlockMatmulQ8_0"),
             ("jaxengine_block_swiglu_q8_0", "BlockSwiGLUQ8_0")),
}
GROUPED_TARGET = ("jaxengine_grouped_matmul_f32", "GroupedMatmulF32")
FLAGS = ("-O3", "-std=c++17", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math",
         "-shared", "-fPIC")
ENV_CACHE = "JAXENGINE_NATIVE_CACHE_DIR"
ENV_ISA = "JAXENGINE_CPU_ISA"

# The x86-64 psABI levels, each with the /proc/cpuinfo flags of every feature it lets the
# compiler use (its own and the levels' below: v2 is SSE3 (pni) to SSE4.2, LZCNT is abm).
_X86_V2 = ("cx16", "lahf_lm", "popcnt", "pni", "ssse3", "sse4_1", "sse4_2")
_X86_V3 = (*_X86_V2, "abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave")
_X86_V4 = (*_X86_V3, "avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl")
# $JAXENGINE_CPU_ISA's named levels, widest first: the compiler flag and the CPU flags needed
# to run its code. The one place that maps names to flags.
X86_ISAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "avx512": ("-march=x86-64-v4", _X86_V4),
    "avx2": ("-march=x86-64-v3", _X86_V3),
    "sse2": ("-march=x86-64", ()),
}


class NativeBuildError(RuntimeError):
    """The CPU kernel could not be compiled or loaded here; the message says why."""


def cache_root() -> Path:
    """`$JAXENGINE_NATIVE_CACHE_DIR`, else `$XDG_CACHE_HOME/jaxengine/native` (`~/.cache/...`)."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxengine" / "native"


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise NativeBuildError("no C++ compiler found (set $CXX, or install g++ or clang++)")


def _cpu_identity() -> str:
    """What `-march=native` depends on: the architecture and, on Linux, the CPU's flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("flags", "model name",
                                                                  "Features"))]  # fmt: skip
        return platform.machine() + "\n" + "\n".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def _cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (the first CPU's), or None without one."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def missing_cpu_flags(name: str) -> tuple[str, ...]:
    """The /proc/cpuinfo flags that x86 ISA level `name` (a key of `X86_ISAS`) needs and this
    CPU lacks: () when it can run that build. Without /proc/cpuinfo every flag counts as
    missing, as nothing says the CPU has it."""
    needs = X86_ISAS[name][1]
    have = _cpu_flags() or frozenset()
    return tuple(f for f in needs if f not in have)


def runnable_isas() -> tuple[str, ...]:
    """The values `$JAXENGINE_CPU_ISA` may take here: "native", then the x86 levels this CPU
    can execute, widest first."""
    if not _is_x86():
        return ("native",)
    return ("native", *(name for name in X86_ISAS if not missing_cpu_flags(name)))


def isa_flags(name: str) -> tuple[str, ...]:
    """The compiler flags of a build for ISA `name` (a `$JAXENGINE_CPU_ISA` value).

    Raises:
      ValueError: an unknown name, an x86 level on another architecture, or one whose code this
        CPU cannot execute (refused here: it would die of an illegal instruction).
    """
    if name == "native":
        return ("-march=native",)
    accepted = ", ".join(("native", *X86_ISAS))
    if name not in X86_ISAS:
        raise ValueError(f"{ENV_ISA}={name!r} is not an ISA the CPU kernels build for; "
                         f"use one of {accepted}")
    if not _is_x86():
        raise ValueError(f"{ENV_ISA}={name!r} names an x86 level, and this machine is "
                         f"{platform.machine()}; use native (or unset {ENV_ISA})")
    if missing := missing_cpu_flags(name):
        why = "lacks" if _cpu_flags() is not None else "may lack (no /proc/cpuinfo)"
        raise ValueError(f"{ENV_ISA}={name!r}: this CPU {why} {', '.join(missing)}, which "
                         f"that build needs; use one of {', '.join(runnable_isas())}")
    return (X86_ISAS[name][0],)


def _build(cxx: str, march: tuple[str, ...]) -> Path:
    """Compile the library (cached) and return its path."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    flags = (*FLAGS, *march)
    texts = [f.read_text() for f in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, cxx, version, " ".join(flags), jaxlib.__version__,
                                    _cpu_identity()]).encode()).hexdigest()
    out = cache_root() / key[:24] / LIBRARY
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
    os.close(fd)
    cmd = [cxx, *flags, "-I", jax.ffi.include_dir(), *map(str, SOURCES), "-o", tmp]
    logger.info("compiling the CPU kernels into %s (once per source, toolchain and CPU)", out)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        raise NativeBuildError(f"compiling the CPU kernels failed ({' '.join(cmd)}):\n"
                               f"{done.stderr[-2000:]}")
    os.replace(tmp, out)
    return out


_lock = threading.Lock()  # engines built in threads (data parallel) load the library once
_library: list[ctypes.CDLL] = []
_library_path: list[Path] = []


def _load() -> ctypes.CDLL:
    """The library, built if need be, its targets registered with XLA (once per process)."""
    with _lock:
        if not _library:
            name = os.environ.get(ENV_ISA) or "native"
            march = isa_flags(name)  # a mistake in the variable is the user's: checked first
            cxx = _compiler()
            try:
                path = _build(cxx, march)
            except NativeBuildError as failed:  # e.g. a compiler without -march=native
                if name != "native":
                    raise
                logger.info("%s; building without -march=native", failed)
                path = _build(cxx, ())
            library = ctypes.cdll.LoadLibrary(str(path))
            for target_name, symbol in (ATTENTION_TARGET, MATMUL_TARGET, SWIGLU_TARGET,
                                        *INT8_TARGETS, *sum(BLOCK_TARGETS.values(), ()),
                                        GROUPED_TARGET):
                jax.ffi.register_ffi_target(
                    target_name, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
            _library.append(library)
            _library_path.append(path)
        return _library[0]


def loaded_path() -> Path | None:
    """The library this process loaded (its directory is named by the hash of everything it
    was built from), or None before the first use; a program calling its kernels needs it
    loaded (`jaxengine.runner.executables` keys on it)."""
    return _library_path[0] if _library_path else None


def target(cache_dtype: jnp.dtype) -> str:
    """The registered attention custom-call target for a cache of `cache_dtype` (built and
    loaded on first use); its queries are float32.

    Raises:
      NativeBuildError: no compiler, or the build failed (the message has its output).
      ValueError: a cache dtype the kernel does not read (one of `CACHE_DTYPES`), or a
        `$JAXENGINE_CPU_ISA` that this machine cannot build for or run (see `isa_flags`).
    """
    if jnp.dtype(cache_dtype) not in CACHE_DTYPES:
        names = ", ".join(d.name for d in CACHE_DTYPES)
        raise ValueError(f"the CPU attention kernel reads a cache of {names}, got "
                         f"{jnp.dtype(cache_dtype)}")
    _load()
    return ATTENTION_TARGET[0]


@functools.cache
def matmul_target() -> tuple[str, int]:
    """The packed matmul's custom-call target and the panel width its weights are packed in
    (built and loaded on first use; raises `NativeBuildError` as `target` does, and is asked
    again then)."""
    library = _load()
    library.PackedMatmulPanel.restype = ctypes.c_int64
    return MATMUL_TARGET[0], int(library.PackedMatmulPanel())


def swiglu_target() -> str:
    """The custom-call target of the packed SwiGLU product (built and loaded on first use;
    raises `NativeBuildError` as `target` does)."""
    _load()
    return SWIGLU_TARGET[0]


def int8_target(*, swiglu: bool) -> str:
    """The custom-call target of the packed matmul over int8 panels (`swiglu`: the fused SwiGLU
    product's); built and loaded on first use, raising `NativeBuildError` as `target` does."""
    _load()
    return INT8_TARGETS[swiglu][0]


def block_target(quant_type: str, *, swiglu: bool) -> str:
    """The custom-call target of the matmul over GGUF blocks of `quant_type` ("Q4_1" or
    "Q8_0"; `swiglu`: the fused SwiGLU product's); built and loaded on first use, raising
    `NativeBuildError` as `target` does.

    Raises:
      ValueError: a type the kernel does not read (the message names those it does).
    """
    if quant_type not in BLOCK_TARGETS:
        raise ValueError(f"the CPU block matmul reads GGUF {', '.join(BLOCK_TARGETS)} blocks, "
                         f"not {quant_type!r}")
    _load()
    return BLOCK_TARGETS[quant_type][swiglu][0]


def grouped_target() -> str:
    """The custom-call target of the grouped matmul (built and loaded on first use; raises
    `NativeBuildError` as `target` does)."""
    _load()
    return GROUPED_TARGET[0]


def isa() -> str:
    """The vector path the loaded library runs, as the binary reports it: "avx512", "avx2",
    "avx", "sse2", "neon" or "generic" (built and loaded on first use; raises
    `NativeBuildError` as `target` does)."""
    library = _load()
    library.JaxengineCpuIsa.restype = ctypes.c_char_p
    return library.JaxengineCpuIsa().decode()


def int8_pairs() -> bool:
    """Whether the loaded library's int8 matmuls meet x in bfloat16 pairs (its build has
    AVX512-BF16: packed_matmul.cc, "PairDot"), rather than in float32; built and loaded on
    first use."""
    library = _load()
    library.PackedInt8Pairs.restype = ctypes.c_int64
    return bool(library.PackedInt8Pairs())


def vector_lanes() -> int:
    """Floats per vector of the loaded library (16, 8 or 4; built and loaded on first use)."""
    library = _load()
    library.JaxengineCpuLanes.restype = ctypes.c_int64
    return int(library.JaxengineCpuLanes())


@functools.cache
def available() -> str | None:
    """None when the kernel builds and loads here, else why not (one line, for a warning).

    Raises:
      ValueError: `$JAXENGINE_CPU_ISA` names an ISA this machine cannot build for or run: a
        mistake to correct, not a reason to fall back to the slower reference.
    """
    try:
        _load()
    except (NativeBuildError, OSError) as e:
        return str(e).splitlines()[0]
    return None
