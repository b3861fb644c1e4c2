"""JAX's persistent compilation cache as the engine uses it (docs/JAX_NOTES.md, "Persistent
compilation cache").

Compiled programs are written to a directory and loaded from it by later processes, which then
skip XLA's compilation. `EngineArgs.compilation_cache_dir` chooses the directory:

- None: `$JAXENGINE_COMPILATION_CACHE_DIR` when set (the test suite points it at a temporary
  directory; '' there disables), else a directory the user gave JAX itself
  (`JAX_COMPILATION_CACHE_DIR` or `jax.config`), else `$XDG_CACHE_HOME/jaxengine/jax`
  (`~/.cache/jaxengine/jax` when XDG_CACHE_HOME is unset);
- '': no persistent cache;
- a path: that directory (created by JAX on first write; `~` is expanded).

JAX keys an entry by the program's HLO, the compile options, the jaxlib version, the backend's
platform version, XLA flags and the devices, so a change of model shapes, dtype, backend or jax
version misses instead of loading a wrong program. JAX's cache is process-global: the setting
of the most recent engine built applies to the whole process (a second engine with another
directory moves it there and logs so; programs already compiled stay in memory either way).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

logger = logging.getLogger("jaxengine.runner")

ENV = "JAXENGINE_COMPILATION_CACHE_DIR"

# Set by the first `configure`: the directory the user had given JAX itself before the engine
# touched it (None: none), and what `configure` applied last (None: the cache disabled).
_configured = False
_user_dir: str | None = None
_applied: str | None = None


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/jaxengine/jax`, or `~/.cache/jaxengine/jax` without XDG_CACHE_HOME."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxengine" / "jax"


def resolve_cache_dir(setting: str | None) -> str | None:
    """The directory `EngineArgs.compilation_cache_dir = setting` means; None: no cache.

    See the module docstring for the order in which None is resolved.
    """
    if setting is None:
        if ENV in os.environ:
            setting = os.environ[ENV]
        elif (user := _user_dir if _configured else _jax_dir()) is not None:
            setting = user  # the user configured JAX's cache directly: keep it
        else:
            setting = str(default_cache_dir())
    if not setting.strip():
        return None
    return str(Path(setting).expanduser().absolute())


def configure(setting: str | None) -> str | None:
    """Point JAX's persistent cache at `resolve_cache_dir(setting)`, before anything compiles.

    Every program the engine compiles is written, however fast it compiled (JAX's default
    threshold of 1 s would leave the sampler and every small model's programs out, which a
    warm process would then compile again). Idempotent; a different directory (or '') than
    the one in use moves the whole process's cache (JAX's is process-global).

    Args:
      setting: `EngineArgs.compilation_cache_dir`.
    Returns:
      the directory in use, or None when the cache is disabled.
    """
    global _configured, _user_dir, _applied
    path = resolve_cache_dir(setting)
    if not _configured:
        _configured, _user_dir = True, _jax_dir()
    elif _applied == path and _jax_dir() == path:
        return path
    elif _applied != path:
        logger.info("persistent compilation cache moves from %s to %s for this process "
                    "(JAX's cache is process-global)", _applied or "(disabled)",
                    path or "(disabled)")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_enable_compilation_cache", path is not None)
    if path is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # JAX opens its cache once, on the first compilation after a directory is set; a reset
    # makes the next compilation open the directory set now.
    jax_cache.reset_cache()
    _applied = path
    return path


def cache_state(loaded: int, programs: int) -> str:
    """How warm the cache was for `programs` programs of which `loaded` came from it: "cold"
    (none), "warm" (all) or "partly warm"."""
    return "cold" if loaded == 0 else "warm" if loaded >= programs else "partly warm"


def shown(path: str) -> str:
    """`path` as logs show it: the home directory written `~`."""
    home = str(Path.home())
    return "~" + path[len(home):] if path == home or path.startswith(home + "/") else path


def active_dir() -> str | None:
    """The directory the engine's last `configure` put JAX's cache in; None: disabled or
    never configured."""
    return _applied


def _jax_dir() -> str | None:
    """JAX's current cache directory setting (None: none set)."""
    return jax.config.jax_compilation_cache_dir or None
