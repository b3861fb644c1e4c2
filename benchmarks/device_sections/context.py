"""What every section of `benchmarks/device_check.py` shares: the run's `Context` and the
report line."""

from __future__ import annotations

from dataclasses import dataclass

PAGE_SIZE = 16  # tokens per KV page in every section


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    """What every section needs to know about this run."""

    impls: tuple[str, ...]  # kernels to check: the device's, or both in the CPU smoke
    interpret: bool  # Pallas interpret mode (CPU smoke)
    smoke: bool  # CPU smoke: tiny sizes, abstract lowering
    quick: bool  # a smaller grid and fewer timing iterations
    peak_gbps: float  # HBM peak for the bandwidth fraction
    iters: int  # timed calls per implementation


def report(section: str, text: str, ok: bool | None = None) -> None:
    """Print one line tagged with its section, with PASS / FAIL when it is a verdict."""
    verdict = "" if ok is None else (" PASS" if ok else " FAIL")
    print(f"[{section}] {text}{verdict}", flush=True)
