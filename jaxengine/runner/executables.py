"""Executables saved whole, so that a warm start neither traces nor lowers (docs/JAX_NOTES.md,
"Executables saved whole").

JAX's persistent cache is keyed by the lowered module, so a process that reads a program from
it has first traced and lowered the program in Python. After the runner compiles a program it
also saves the executable itself (`jax.experimental.serialize_executable`: XLA's bytes and the
argument and result trees), under `<compilation cache dir>/executables/`, keyed by what can be
known without tracing; a later process loads it by that key. A stale executable must never
load, so the key covers everything the program is made of:

- the program's name, its static arguments, and its arguments' abstract values: tree
  structure, shapes, dtypes, weak types and shardings (never their values);
- the model's signature (`jaxengine.model.fns.signature`: what its step and logits functions
  close over, their graph's static attributes included);
- the code: the sources of `jaxengine` and `jaxengine_kernels`, and on CPU the kernels'
  library, loaded before any key is made (its path names a hash of its sources, toolchain
  and CPU);
- the platform: Python's, jax's, jaxlib's, flax's, numpy's and ml_dtypes's versions, the
  backend's platform and version, the devices it runs on and all of the process's, the CPU,
  `XLA_FLAGS`/`LIBTPU_INIT_ARGS` and jax's configuration (the options about caches left out).

An executable JAX read from its persistent cache cannot be saved whole: XLA:CPU serializes
it again without its compiled functions (a later load fails to run: "Function wrapped_tanh not
found", measured on jax 0.12). So a program whose saved executable missed is compiled with
`compiler_options(key)`, which puts the key into its compile options and with them into JAX's
cache key: JAX misses too, XLA compiles it for real, and that executable is saved. The option
is `xla_debug_buffer_assignment_show_max`, which only sets how many buffers an error message
about buffer assignment lists. When JAX's cache has that entry all the same (an earlier run
compiled the program, but its file was lost or is corrupt), the runner compiles it once more
under `attempt=1`'s options, and saves that.

A file holds a header, the payload's SHA-256 and the pickled executable: a truncated or
corrupt file is refused before XLA reads it. Devices in the argument trees (a mesh in a
parameter's metadata, which parameters made with `mesh=` keep: an HF checkpoint's, a GGUF
model's) are pickled by id and read back as the backend's devices of those ids. Any miss or
failed load returns None, logged, and the runner compiles instead. Files are written to a
temporary name and renamed, so processes starting at once never read half a file. Loading a
file runs what it holds (it is unpickled, then XLA's code in it): like JAX's own cache, the
directory must be writable only by those trusted to run code as this user.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import io
import logging
import os
import pickle
import platform
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jaxlib
from jax.experimental import serialize_executable

import jaxengine_kernels
from jaxengine_kernels.cpu import native

logger = logging.getLogger("jaxengine.runner")

SUBDIR = "executables"
MAGIC = b"jaxengine executable 1\n"
_SOURCES = (".py", ".cc", ".h")
_ENV = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")


def program_key(name: str, args: Any, statics: dict[str, Any], *, signature: str,
                devices: Sequence[jax.Device]) -> str:
    """The hex key of one program (see the module docstring for what it covers).

    Args:
      name: the jitted function's name (`programs.STEP_NAME`, ...).
      args: its arguments as `jax.ShapeDtypeStruct`s (a pytree), as it is lowered.
      statics: its static arguments by name (their reprs are keyed: plain values, shardings).
      signature: the model's (`jaxengine.model.fns.signature`).
      devices: the devices it runs on, in the order of its device assignment.
    """
    leaves, tree = jax.tree.flatten(args)
    parts = [name, signature, str(tree), repr(sorted(statics.items())),
             *map(_leaf, leaves), repr([(d.platform, d.id) for d in devices]),
             _platform(), _code()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def compiler_options(key: str, *, attempt: int = 0) -> dict[str, int]:
    """XLA options that make JAX's persistent cache key of a program depend on `key` (and
    `attempt`: a second set JAX's cache has not seen), and nothing else about the program
    (see the module docstring)."""
    return {"xla_debug_buffer_assignment_show_max": int(key[:15], 16) + attempt}


def load(cache_dir: str, name: str, key: str, devices: Sequence[jax.Device]
         ) -> jax.stages.Compiled | None:
    """The executable saved under `key`, loaded onto `devices`; None (logged) when there is
    none or it cannot be read."""
    path = _path(cache_dir, name, key)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        logger.info("no saved executable of %s for these shapes and code: compiling it", name)
        return None
    except OSError as e:
        logger.warning("cannot read the saved executable %s (%s): compiling it", path, e)
        return None
    try:
        payload, in_tree, out_tree = _unpack(data, devices[0].client.devices())
        return serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, backend=devices[0].client,
            execution_devices=list(devices))
    except Exception as e:  # noqa: BLE001 — any failure to load means: compile instead
        logger.warning("cannot load the saved executable %s (%s: %s): compiling it", path,
                       type(e).__name__, e)
        return None


def save(cache_dir: str, name: str, key: str, compiled: jax.stages.Compiled) -> None:
    """Save `compiled` under `key` (atomically); a failure is logged, never raised (the
    program is compiled and runs either way)."""
    path, tmp = _path(cache_dir, name, key), None
    try:
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        out = io.BytesIO()
        _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump((payload, in_tree, out_tree))
        body = out.getvalue()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 — a cache that cannot be written is only slower
        logger.warning("cannot save the executable of %s to %s (%s: %s)", name, path,
                       type(e).__name__, e)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _path(cache_dir: str, name: str, key: str) -> Path:
    return Path(cache_dir) / SUBDIR / f"{name}-{key}.exe"


def _unpack(data: bytes, devices: Sequence[jax.Device]) -> tuple[bytes, Any, Any]:
    """(payload, in_tree, out_tree) of a saved file's bytes, its devices those of `devices`
    with the same ids; ValueError if it is not one whole."""
    if not data.startswith(MAGIC):
        raise ValueError("not a saved executable (bad header)")
    digest, _, body = data[len(MAGIC):].partition(b"\n")
    if hashlib.sha256(body).hexdigest().encode() != digest:
        raise ValueError("checksum mismatch (truncated or corrupt)")
    return _Unpickler(io.BytesIO(body), devices).load()


class _Pickler(pickle.Pickler):
    """A pickler that writes a device as its id (a device itself does not pickle)."""

    def persistent_id(self, obj: Any) -> tuple[str, int] | None:
        return ("device", obj.id) if isinstance(obj, jax.Device) else None


class _Unpickler(pickle.Unpickler):
    """Reads what `_Pickler` wrote, a device id as the device of `devices` with that id."""

    def __init__(self, file: io.BytesIO, devices: Sequence[jax.Device]) -> None:
        super().__init__(file)
        self._devices = {d.id: d for d in devices}

    def persistent_load(self, pid: tuple[str, int]) -> jax.Device:
        kind, device_id = pid
        if kind != "device" or device_id not in self._devices:
            raise ValueError(f"the executable names device {pid!r}, which this backend lacks")
        return self._devices[device_id]


def _leaf(x: Any) -> str:
    """One argument's abstract value, as keyed."""
    return (f"{x.shape}:{x.dtype}:{getattr(x, 'weak_type', False)}:"
            f"{getattr(x, 'sharding', None)!r}")


def _platform() -> str:
    """What every program here depends on besides itself: versions, devices, CPU, flags."""
    backend = jax.devices()[0].client
    if backend.platform == "cpu":
        # Loaded (and so keyed) whether or not a program was traced before: a program that
        # calls its kernels needs them registered before it is loaded.
        native.available()
    config = sorted((k, repr(v)) for k, v in jax.config.values.items() if "cache" not in k)
    return "\0".join([*_versions(), backend.platform,
                      backend.platform_version, repr([(d.platform, d.device_kind, d.id)
                                                      for d in jax.devices()]),
                      _cpu(), *(os.environ.get(v, "") for v in _ENV), repr(config),
                      str(native.loaded_path())])


@functools.cache
def _versions() -> tuple[str, ...]:
    """Python's and the versions of the libraries a program is traced and compiled with."""
    def version(name: str) -> str:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            return f"{name} absent"

    return (platform.python_version(), f"jax {jax.__version__}", f"jaxlib {jaxlib.__version__}",
            *map(version, ("flax", "numpy", "ml_dtypes")))


@functools.cache
def _cpu() -> str:
    """The CPU XLA compiled for: the architecture, model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    keep = sorted({ln for ln in lines if ln.startswith(("flags", "model name", "Features"))})
    return platform.machine() + "\n" + "\n".join(keep)


@functools.cache
def _code() -> str:
    """A hash of the sources of the packages that make the programs."""
    h = hashlib.sha256()
    for root in (Path(__file__).resolve().parents[1], Path(jaxengine_kernels.__file__).parent):
        for f in sorted(root.rglob("*")):
            if f.suffix in _SOURCES and "__pycache__" not in f.parts:
                h.update(f"{root.name}/{f.relative_to(root)}\0".encode() + f.read_bytes())
    return h.hexdigest()

