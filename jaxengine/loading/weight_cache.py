"""Derived weights cached on disk: a GGUF file's tensors dequantized to floats and stacked, as
`load_weight` makes them, and its parsed header (metadata and tensor names), saved by the first
load and read back by the next ones, which then do not parse the file at all.

On a 2-vCPU machine that spares a start the `gguf` reader's parse of the header (0.5 s; the
JSON reads back in 0.03 s) and most of the second dequantizing and stacking the default model's
Q4_1 tensors takes, for 0.54 GB of disk (docs/BENCHMARKS.md §14). An entry holds one `.npy` per
weight (module path) and host dtype, before the mesh's layout (`to_layout`), so one entry serves
any tp size and weight format read from floats.

Soundness: an entry's key is the file's identity (its real path, size, modification time and
the sha256 of its first MiB) and the derivation's version (`code_version`:
the source of the loading code and the versions of `gguf` and numpy); a changed file or code
misses. Each array is written to a temporary file and renamed into place, so a reader sees a
whole array or none, and an array that does not read back with the shape and dtype the model
expects (a truncated or foreign file) is logged and derived again. Writing a file's entry
removes that file's older entries but the newest other one (`KEEP`): two checkouts of different
loading code on one machine then keep one entry each instead of replacing each other's.

`$JAXENGINE_WEIGHT_CACHE_DIR` chooses the directory ('' disables the cache), else
`$XDG_CACHE_HOME/jaxengine/weights` (`~/.cache/jaxengine/weights`). Files larger than
`MAX_FILE_BYTES` are not cached: their floats would take several times the file on disk.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path as FsPath
from typing import IO, Any

import numpy as np

from jaxengine.model.families.family import Path

logger = logging.getLogger("jaxengine.loading")

ENV = "JAXENGINE_WEIGHT_CACHE_DIR"
# ~0.6B parameters at Q4_1 (2.6 GB of float32); the default model's file is 98 MB
MAX_FILE_BYTES = 400 << 20
KEEP = 2  # entries kept per file path: this one and the newest other
_HEAD_BYTES = 1 << 20  # the header (metadata, tensor table) of a GGUF file, hashed into the key
# the modules whose code decides what an entry holds: a change to any of them misses
_DERIVATION = ("gguf_file.py", "weights.py", "weight_cache.py")


def cache_dir() -> FsPath | None:
    """The cache's directory: `$JAXENGINE_WEIGHT_CACHE_DIR` ('' disables: None), else
    `$XDG_CACHE_HOME/jaxengine/weights` (`~/.cache/jaxengine/weights`)."""
    setting = os.environ.get(ENV)
    if setting is None:
        base = os.environ.get("XDG_CACHE_HOME") or FsPath.home() / ".cache"
        return FsPath(base) / "jaxengine" / "weights"
    return FsPath(setting).expanduser() if setting.strip() else None


@functools.cache
def code_version() -> str:
    """A digest of what derives an entry: the loading modules' source, the family tables'
    (names, permutations, norm offsets), and the versions of `gguf` (its dequantizers) and
    numpy."""
    here = FsPath(__file__).parent
    sources = [here / name for name in _DERIVATION]
    sources += sorted((here.parent / "model" / "families").glob("*.py"))
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.read_bytes())
    for package in ("gguf", "numpy"):
        digest.update(importlib.metadata.version(package).encode())
    return digest.hexdigest()[:16]


class WeightCache:
    """The entry of one file's weights; `get` and `put` by module path and host dtype."""

    def __init__(self, root: FsPath, file: str, *, version: str | None = None) -> None:
        """Find (or name) the entry of `file`'s weights.

        Args:
            root: the cache's directory (`cache_dir()`).
            file: the checkpoint the weights are derived from.
            version: the derivation's version (default: `code_version()`).
        """
        real, stat = os.path.realpath(file), os.stat(file)
        with open(real, "rb") as f:
            head = hashlib.sha256(f.read(_HEAD_BYTES)).hexdigest()
        owner = hashlib.sha256(real.encode()).hexdigest()[:16]
        identity = json.dumps([real, stat.st_size, stat.st_mtime_ns, head,
                               version or code_version()])
        self.root = root
        self._prefix = f"{owner}-"
        self.dir = root / (self._prefix + hashlib.sha256(identity.encode()).hexdigest()[:16])
        self._cleaned = False

    def _file(self, path: Path, dtype: np.dtype) -> FsPath:
        return self.dir / f"{'-'.join(map(str, path))}.{np.dtype(dtype).name}.npy"

    def get(self, path: Path, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """The cached weight at module `path` in `dtype`, or None when the entry lacks it or
        it does not read back as `shape` and `dtype` (logged; the caller derives it again)."""
        file = self._file(path, dtype)
        if not file.is_file():
            return None
        try:
            # Mapped, not read: the loader's copy onto the device is then the only pass over
            # the bytes (entries are replaced by rename, never rewritten in place).
            array = np.load(file, mmap_mode="r", allow_pickle=False)
        except Exception as e:  # a truncated or foreign file: numpy raises several types
            logger.warning("weight cache: %s does not read (%s: %s); deriving it again",
                           file, type(e).__name__, e)
            return None
        if array.shape != shape or array.dtype != _bits(dtype):
            logger.warning("weight cache: %s holds %s %s, expected %s %s; deriving it again",
                           file, array.dtype, array.shape, _bits(dtype), shape)
            return None
        return array.view(dtype)

    def put(self, path: Path, array: np.ndarray) -> None:
        """Save the weight at module `path` in its dtype (`_write`'s way)."""
        self._write(self._file(path, array.dtype), lambda f: np.save(
            f, np.ascontiguousarray(array).view(_bits(array.dtype)), allow_pickle=False))

    def get_json(self, name: str) -> Any:
        """The value saved as `name` by `put_json`, or None when absent or unreadable
        (logged)."""
        file = self.dir / f"{name}.json"
        if not file.is_file():
            return None
        try:
            return json.loads(file.read_text())
        except (OSError, ValueError) as e:
            logger.warning("weight cache: %s does not read (%s: %s); deriving it again",
                           file, type(e).__name__, e)
            return None

    def put_json(self, name: str, value: Any) -> None:
        """Save `value` as `name` (`_write`'s way); one JSON cannot hold is logged, not saved."""
        try:
            text = json.dumps(value)
        except (TypeError, ValueError) as e:
            logger.warning("weight cache: %s is not saved (%s)", name, e)
            return
        self._write(self.dir / f"{name}.json", lambda f: f.write(text.encode()))

    def _write(self, file: FsPath, write: Callable[[IO[bytes]], object]) -> None:
        """`write` into a temporary file renamed to `file`, so a reader sees all or nothing; a
        failure is logged, never raised (the load goes on without the cache)."""
        try:
            self._remove_stale()
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    write(f)
                os.replace(tmp, file)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            logger.warning("weight cache: cannot write %s (%s); loading without it", file, e)

    def _remove_stale(self) -> None:
        """Remove this file's entries under other keys (the file or the code changed) but
        the `KEEP - 1` newest."""
        if self._cleaned:
            return
        self._cleaned = True
        others = [d for d in self.root.glob(self._prefix + "*") if d != self.dir]
        others.sort(key=_written, reverse=True)
        for other in others[KEEP - 1:]:
            shutil.rmtree(other, ignore_errors=True)


def _written(entry: FsPath) -> int:
    """When an entry last changed (ns); 0 if another process removed it meanwhile."""
    try:
        return entry.stat().st_mtime_ns
    except OSError:
        return 0


def _bits(dtype: np.dtype) -> np.dtype:
    """The unsigned integers an array of `dtype` is saved as: `.npy` cannot name ml_dtypes'
    bfloat16 (it reads back as void), and the file's name says the dtype anyway."""
    return np.dtype(f"u{np.dtype(dtype).itemsize}")


def weight_cache(file: str) -> WeightCache | None:
    """The cache entry for `file`'s weights, or None when the cache is disabled or the file is
    larger than `MAX_FILE_BYTES`."""
    root = cache_dir()
    if root is None or os.path.getsize(file) > MAX_FILE_BYTES:
        return None
    return WeightCache(root, file)
