"""Fixtures of the CPU kernel tests."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import pytest

from pallas_kernels.cpu import native


@pytest.fixture(scope="session")
def isa_library(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], ctypes.CDLL]:
    """`load(isa)`: the native library built for an x86 ISA level (`"-march=x86-64-v3"`) in a
    build cache of the session's own, so that the attention and the matmul tests load the
    same build (native's cache compiles each level once: about 10 s of g++ on 2 cores)."""
    root = tmp_path_factory.mktemp("isa-builds")

    def load(isa: str) -> ctypes.CDLL:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(native.ENV_CACHE, str(root))
            path = native._build(native._compiler(), (isa,))
        return ctypes.cdll.LoadLibrary(str(path))

    return load
