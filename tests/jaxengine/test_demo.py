"""`make demo`'s line on compilation: compiled or loaded, from counted cache hits."""

from __future__ import annotations

from pathlib import Path

from jaxengine.demo import compile_summary


def test_the_compile_line_says_whether_the_cache_was_warm() -> None:
    home = str(Path.home() / ".cache" / "jaxengine" / "jax")
    assert compile_summary(14, 0, 23.14, home) == (
        "compiled 14 programs in 23.1s (cache cold: ~/.cache/jaxengine/jax; the next run loads "
        "them)")
    assert compile_summary(14, 14, 3.2, "/tmp/c") == (
        "loaded 14 programs from the cache in 3.2s (cache warm: /tmp/c)")
    assert compile_summary(14, 11, 5.0, "/tmp/c") == (
        "compiled 3 and loaded 11 programs from the cache in 5.0s (cache partly warm: /tmp/c)")
    assert compile_summary(14, 0, 23.1, None) == (
        "compiled 14 programs in 23.1s (persistent cache disabled)")
